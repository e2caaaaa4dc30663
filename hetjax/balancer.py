"""How the global batch is split between hosts. Pure numpy, no JAX.

Every host computes the assignment itself from values every host holds
(docs/design.md invariant 3), so an assignment policy must be deterministic. This
module holds the policies that need no profiling (`equal`, a fixed explicit
split) and the profiling one (`ProfilingBalancer`: a robust per-host cost
model fitted online, and an exact integer min-max solver), all behind the
same `Balancer` protocol: `shares(step)` before a step, `observe(...)` with
the timing vector after it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import numpy as np


class Balancer(Protocol):
  """Decides each host's share of the global batch, step by step."""

  name: str

  def shares(self, step: int) -> tuple[int, ...]:
    """The per-host batch sizes for `step`; they sum to the global batch."""
    ...

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    """Feeds back every host's measured local compute seconds for `step`."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """What a checkpoint must hold to continue with the same split (JSON-able)."""
    ...

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`; raises `ValueError` if it belongs to another job."""
    ...


def equal_split(global_batch: int, num_hosts: int) -> tuple[int, ...]:
  """The plain DDP split: `B // N` each, the remainder to the first hosts."""
  base, rest = divmod(global_batch, num_hosts)
  return tuple(base + (1 if i < rest else 0) for i in range(num_hosts))


def validate_shares(shares: Sequence[int], global_batch: int, num_hosts: int) -> tuple[int, ...]:
  """Checks an explicit split; raises `ValueError` naming what is wrong."""
  shares = tuple(int(s) for s in shares)
  if len(shares) != num_hosts:
    raise ValueError(f"assignment {','.join(map(str, shares))} has {len(shares)} entries "
                     f"but the job has {num_hosts} hosts; give one share per host.")
  if any(s < 0 for s in shares):
    raise ValueError(f"assignment {','.join(map(str, shares))} has a negative share; "
                     "every share must be >= 0.")
  if sum(shares) != global_batch:
    raise ValueError(f"assignment {','.join(map(str, shares))} sums to {sum(shares)} "
                     f"but the global batch is {global_batch}; the shares must add up to it.")
  return shares


def parse_assignment(text: str) -> str | tuple[int, ...]:
  """Parses `--assignment`: the word `equal` or comma-separated integers."""
  text = text.strip()
  if text == "equal":
    return "equal"
  try:
    return tuple(int(p) for p in text.split(","))
  except ValueError:
    raise ValueError(f"--assignment must be 'equal' or comma-separated integers such as "
                     f"5,23,36; got {text!r}.") from None


class FixedBalancer:
  """The same split at every step (`equal`, or one given by hand)."""

  def __init__(self, shares: Sequence[int], name: str = "fixed"):
    self._shares = tuple(int(s) for s in shares)
    self.name = name

  def shares(self, step: int) -> tuple[int, ...]:
    return self._shares

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    del step, shares, compute_s  # A fixed split learns nothing.

  def state_dict(self) -> dict[str, Any]:
    return {"kind": self.name, "shares": list(self._shares)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    _check_state(state, kind=self.name, shares=list(self._shares))


# ---------------------------------------------------------------------------
# Cost model: what a share costs on each host.
# ---------------------------------------------------------------------------

MODES = ("fixed", "equal", "static", "dynamic")
_MIN_PER_SAMPLE_S = 1e-12  # Keeps the solver's division finite for a degenerate fit.


def padded(shares: Sequence[int] | np.ndarray, granularity: Sequence[int] | np.ndarray) -> np.ndarray:
  """Samples a host really computes: whole micro-batches, the last one masked."""
  b = np.asarray(shares, dtype=np.int64)
  g = np.asarray(granularity, dtype=np.int64)
  return -(-b // g) * g


@dataclasses.dataclass(frozen=True)
class CostParams:
  """Per-host `t_i(b) = fixed_i + per_sample_i * ceil(b / g_i) * g_i`, and `t_i(0) = 0`.

  A host with share 0 runs no micro-batch, so it costs nothing in the local
  program (it still joins the collective, which is outside this model).
  """

  fixed_s: np.ndarray
  per_sample_s: np.ndarray
  granularity: np.ndarray

  def predict(self, shares: Sequence[int] | np.ndarray) -> np.ndarray:
    """Predicted local compute seconds of every host for `shares`."""
    x = padded(shares, self.granularity)
    return np.where(x > 0, self.fixed_s + self.per_sample_s * x, 0.0)


def _check_state(state: dict[str, Any], **expected: Any) -> None:
  """Refuses balancer state written for another mode, batch or host count."""
  differ = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
  if differ:
    what = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
    raise ValueError(f"the saved balancer state belongs to another configuration ({what}); "
                     "start the balancer afresh instead of restoring it.")


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Column-wise lower weighted median of `[m, H]`; also says which columns had weight."""
  values = np.where(weights > 0, values, np.inf)
  order = np.argsort(values, axis=0, kind="stable")
  v = np.take_along_axis(values, order, axis=0)
  cw = np.cumsum(np.take_along_axis(weights, order, axis=0), axis=0)
  total = cw[-1] if len(cw) else np.zeros(values.shape[1])
  pick = np.argmax(cw >= 0.5 * total, axis=0)
  ok = total > 0
  return np.where(ok, v[pick, np.arange(values.shape[1])] if len(v) else 0.0, np.nan), ok


class CostModel:
  """Fits every host's cost online from the timing vectors, robustly.

  The model is `t_i(b) = a_i * (c_i + padded(b))`: `a_i` is seconds per sample
  (the level, which moves when a host changes speed) and `c_i` the fixed cost
  counted in samples (the shape, which a speed change scales with it).
  - shape `c_i`: the weighted median of the shapes that pairs of observations
    give alone (`c = y_j dx / dy - x_j`; the level cancels within a pair, so a
    later speed change cannot leak in), so a minority of outliers cannot move
    it. Only pairs at most `pair_steps` apart whose padded shares differ by at
    least `min_spread` of the larger one (widened to 8 sigma of the measured
    noise, at most 0.6) count: a slope read off a 1 % share difference under
    3 % noise is noise, and one such misfit once made a host look almost free
    per sample (25.9x its optimal share at 1024 simulated hosts). The shape is
    bounded to `[0, max_fixed_ratio x max(B / N, largest share seen)]`
    (a fixed cost larger than that is not plausible, and an overestimate is
    what hurts: it makes the per-sample cost look small). Without enough
    spread (a settled split) the last identified shape is kept; before any,
    the prior: fixed part = `prior_fixed_fraction` of the observed time.
  - level `a_i`: recency-weighted median of `t / (c_i + padded(b))` (half-life
    `half_life` steps): one slow step has at most ~1/4 of the weight and cannot
    move a median, while a host that really slows down wins the median within
    about `half_life` steps.
  """

  def __init__(self, num_hosts: int, granularity: Sequence[int], *, window: int = 32,
               half_life: float = 3.0, prior_fixed_fraction: float = 0.1,
               min_spread: float = 0.25, max_fixed_ratio: float = 2.0,
               typical_share: float | None = None, pair_steps: int = 6):
    if window < 2:
      raise ValueError(f"cost model window must be >= 2 observations, got {window}.")
    if not 0.0 <= prior_fixed_fraction < 1.0:
      raise ValueError(f"prior_fixed_fraction must be in [0, 1), got {prior_fixed_fraction}.")
    if not 0.0 < min_spread < 1.0:
      raise ValueError(f"min_spread must be in (0, 1) (a relative share difference), got "
                       f"{min_spread}.")
    if not max_fixed_ratio > 0.0:
      raise ValueError(f"max_fixed_ratio must be > 0 (fixed cost bound, in shares), got "
                       f"{max_fixed_ratio}.")
    self.min_spread, self.max_fixed_ratio = float(min_spread), float(max_fixed_ratio)
    self.pair_steps = int(pair_steps)
    # B / N: the scale of a plausible fixed cost, whatever share a host runs now.
    self.typical_share = float(typical_share) if typical_share else 0.0
    self.noise = 0.0  # Typical relative noise of one measured time (1.4826 MAD).
    self.num_hosts = num_hosts
    self.granularity = np.asarray(granularity, dtype=np.int64)
    self.window, self.half_life = window, float(half_life)
    self.prior_fixed_fraction = prior_fixed_fraction
    self._x = np.zeros((0, num_hosts))
    self._y = np.zeros((0, num_hosts))
    self._shape = np.full(num_hosts, np.nan)  # c_i, samples; NaN until known.
    self.level_error = 0.0  # Typical relative error of a host's fitted level.
    pairs = np.triu_indices(window, 1)
    self._pairs = (pairs[0], pairs[1])

  @property
  def num_observations(self) -> int:
    return len(self._x)

  def observe(self, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    """Adds one step's (share, seconds) of every host to the window."""
    x = padded(shares, self.granularity).astype(np.float64)
    y = np.asarray(compute_s, dtype=np.float64)
    self._x = np.vstack([self._x, x[None]])[-self.window:]
    self._y = np.vstack([self._y, y[None]])[-self.window:]

  def state_dict(self) -> dict[str, Any]:
    """The observation window and the identified shapes, as plain lists."""
    return {"x": self._x.tolist(), "y": self._y.tolist(),
            "shape": [None if np.isnan(v) else float(v) for v in self._shape]}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    x = np.asarray(state["x"], np.float64).reshape(-1, self.num_hosts)
    y = np.asarray(state["y"], np.float64).reshape(-1, self.num_hosts)
    self._x, self._y = x[-self.window:], y[-self.window:]
    self._shape = np.array([np.nan if v is None else v for v in state["shape"]], np.float64)

  def fit(self) -> CostParams:
    """The current per-host parameters; needs at least one observation."""
    if not len(self._x):
      raise ValueError("the cost model has no observations yet; call observe() first.")
    x, y = self._x, self._y
    n = len(x)
    w = 0.5 ** ((n - 1 - np.arange(n)) / self.half_life)
    valid = (x > 0) & np.isfinite(y) & (y > 0)
    wv = np.where(valid, w[:, None], 0.0)
    if np.isnan(self._shape).any():  # Never identified: the prior, until a spread shows it.
      xm, _ = _weighted_median(x, wv)
      f = self.prior_fixed_fraction
      self._shape = np.where(np.isnan(self._shape), f / (1 - f) * np.nan_to_num(xm, nan=1.0),
                             self._shape)
    # The noise, with the shapes held so far, sets how wide a spread must be to count.
    self.noise = self._fit_level(x, y, wv)[2]
    self._update_shape(x, y, wv)
    level, spread, self.noise = self._fit_level(x, y, wv)
    sw = wv.sum(axis=0)
    n_eff = np.where(sw > 0, sw ** 2 / np.maximum((wv ** 2).sum(axis=0), 1e-300), 1.0)
    # Relative standard error of each level (x1.25 for a median).
    self.level_error = float(np.median(1.25 * spread / np.sqrt(n_eff)))
    return CostParams(fixed_s=level * self._shape, per_sample_s=level, granularity=self.granularity)

  def _fit_level(self, x: np.ndarray, y: np.ndarray,
                 wv: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Levels under the current shapes, each host's noise sigma, and the typical sigma."""
    level, ok = _weighted_median(y / (self._shape + np.maximum(x, 1.0)), wv)
    # A host never seen working (share 0 throughout) is assumed typical.
    fallback = float(np.median(level[ok])) if ok.any() else 1.0
    level = np.maximum(np.where(ok, level, fallback), _MIN_PER_SAMPLE_S)
    rel = np.abs(y / (level * (self._shape + np.maximum(x, 1.0))) - 1.0)
    mad, ok = _weighted_median(rel, wv)
    sigma = np.where(ok, 1.4826 * np.nan_to_num(mad), 0.0)  # MAD -> sigma.
    return level, sigma, float(np.median(sigma[ok])) if ok.any() else 0.0

  def _update_shape(self, x: np.ndarray, y: np.ndarray, wv: np.ndarray) -> None:
    n = len(x)
    keep = (self._pairs[1] < n) & (self._pairs[1] - self._pairs[0] <= self.pair_steps)
    j, k = self._pairs[0][keep], self._pairs[1][keep]
    if not len(j):
      return
    dx = x[k] - x[j]
    # Only share differences large against the noise identify a fixed cost.
    spread = min(max(self.min_spread, 8.0 * self.noise), 0.6)
    # Pairs are close in time (`keep` above): across a slow spell a share change
    # and a speed change mix, and their slope says nothing about the fixed cost.
    wide = np.abs(dx) >= spread * np.maximum(x[k], x[j])
    pw = np.where(wide, wv[j] * wv[k], 0.0)
    if not pw.any():
      return
    # Each pair alone gives the shape, `c = y_j dx / dy - x_j`, whatever the level
    # (it cancels within a pair): a later speed change cannot leak into it.
    dy = y[k] - y[j]
    rising = wide & (dy * dx > 0)
    pair_shape = y[j] * dx / np.where(rising, dy, 1.0) - x[j]
    shape, ok = _weighted_median(pair_shape, np.where(rising, pw, 0.0))
    if not ok.any():
      return
    shape = np.nan_to_num(shape)
    # A plausible fixed cost is at most `max_fixed_ratio` of a typical share's work.
    bound = self.max_fixed_ratio * np.maximum(self.typical_share, x.max(axis=0))
    self._shape = np.where(ok, np.clip(shape, 0.0, bound), self._shape)


# ---------------------------------------------------------------------------
# Solver: the integer split that minimises the slowest host's predicted time.
# ---------------------------------------------------------------------------


def solve(global_batch: int, fixed_s: Sequence[float], per_sample_s: Sequence[float],
          granularity: Sequence[int], caps: Sequence[int] | None = None,
          floors: Sequence[int] | None = None) -> tuple[int, ...]:
  """Integer shares `b_i`, `sum = B`, `floor_i <= b_i <= cap_i`, minimising `max_i t_i(b_i)`.

  Exact for the step-function cost `t_i(b) = fixed_i + per_sample_i *
  ceil(b / g_i) * g_i` (`t_i(0) = 0`): bisection over the time T finds the
  smallest level at which the hosts' capacities (largest share each can run
  within T) hold B; the samples beyond the level just below it go to the
  hosts that reach the level, lowest host index first. A floor only raises
  a host's capacity at every level, so the same bisection stays exact. O(N)
  per bisection step, about 60 steps.

  Example:
    >>> solve(10, [0, 0], [1.0, 3.0], [1, 1])
    (8, 2)
  """
  f = np.maximum(np.asarray(fixed_s, dtype=np.float64), 0.0)
  p = np.maximum(np.asarray(per_sample_s, dtype=np.float64), _MIN_PER_SAMPLE_S)
  g = np.asarray(granularity, dtype=np.int64)
  n = len(f)
  if not (len(p) == len(g) == n) or n < 1:
    raise ValueError(f"solve needs one fixed, per-sample and granularity value per host; got "
                     f"{len(f)}, {len(p)} and {len(g)}.")
  if (g < 1).any():
    raise ValueError(f"granularity must be >= 1 sample per micro-batch, got {g.tolist()}.")
  if global_batch < 0:
    raise ValueError(f"global batch must be >= 0, got {global_batch}.")
  cap = np.full(n, global_batch, np.int64) if caps is None else np.asarray(caps, dtype=np.int64)
  if len(cap) != n or (cap < 0).any():
    raise ValueError(f"caps must be one value >= 0 per host ({n} hosts), got {cap.tolist()}.")
  cap = np.minimum(cap, global_batch)
  if int(cap.sum()) < global_batch:
    raise ValueError(f"the caps sum to {int(cap.sum())} samples but the global batch is "
                     f"{global_batch}; raise the caps or lower the global batch.")
  low = np.zeros(n, np.int64) if floors is None else np.asarray(floors, dtype=np.int64)
  if len(low) != n or (low < 0).any() or (low > cap).any() or int(low.sum()) > global_batch:
    raise ValueError(f"floors must be one value per host ({n} hosts) in [0, cap] summing to at "
                     f"most the global batch {global_batch}; got {low.tolist()}.")
  if global_batch == 0:
    return (0,) * n
  unit = p * g  # Seconds of one micro-batch.
  kmax = -(-cap // g)

  inv_unit, kmax_f, g_f, cap_f = 1.0 / unit, kmax.astype(np.float64), g.astype(np.float64), cap.astype(np.float64)
  low_f = low.astype(np.float64)

  def capacity(t: float) -> np.ndarray:
    # The small slack makes t == a level's exact cost count as reaching it.
    k = np.minimum(np.maximum(np.floor((t - f) * inv_unit + 1e-9), 0.0), kmax_f)
    return np.maximum(np.minimum(k * g_f, cap_f), low_f)

  lo, hi = 0.0, float(np.max(np.where(cap > 0, f + unit * kmax, 0.0)))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    # Levels closer than 1e-12 (relative) count as a tie.
    if not lo < mid < hi or hi - lo <= 1e-12 * hi:
      break
    if int(capacity(mid).sum()) >= global_batch:
      hi = mid
    else:
      lo = mid
  base = (capacity(lo) if lo > 0 else low_f).astype(np.int64)
  extra = capacity(hi).astype(np.int64) - base
  rest = global_batch - int(base.sum())
  before = np.cumsum(extra) - extra
  give = np.clip(rest - before, 0, extra)
  return tuple(int(v) for v in base + give)


def _round_to_sum(values: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
  """Integers near `values` (each within `[0, cap]`) that sum to `total`."""
  values = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
  if values.sum() > total:  # Scale down first: the loop below can only add.
    values = values * (total / values.sum())
  out = np.minimum(np.floor(np.maximum(values, 0.0)).astype(np.int64), caps)
  frac = np.maximum(values, 0.0) - out
  order = np.lexsort((np.arange(len(values)), -frac))  # Largest fraction, then index.
  rest = total - int(out.sum())
  for pass_limit in (1, None):  # One each by fraction first, then fill any room left.
    for i in order:
      if rest <= 0:
        break
      room = int(caps[i] - out[i])
      add = min(room, rest) if pass_limit is None else min(room, rest, 1)
      out[i] += add
      rest -= add
  return out


# ---------------------------------------------------------------------------
# The profiling balancer.
# ---------------------------------------------------------------------------


class ProfilingBalancer:
  """Sizes each host's share from its measured speed (`static` or `dynamic`).

  Warm-up (`warmup_steps`, default 7): step 0 (compilation) is run at the equal
  split and ignored; the rest probe the equal split, then two perturbed splits
  (even hosts x1.5 / odd x0.5, then the reverse) so that every host is seen at
  distinct shares and its fixed and per-sample costs can be told apart.
  Then `static` solves once and keeps the split; `dynamic` re-solves every
  `every` steps and moves only if the slowest host's predicted time drops by
  more than `threshold` (relative), by at most `max(max_move, gain) * B`
  samples per host at once: a dead band and a rate limit, so noise does not
  make it oscillate, while a host that really slows down is answered in one
  move.

  Trust region: every solve keeps each host's share at most `trust` x the
  largest padded share it ran in the last `2 * every` measured steps (at
  least one micro-batch): the model is only known near shares a host has
  run, so a misfit costs at most one bounded step, never a pathological one.
  The first solve also keeps each share at least `smallest / trust`: there
  one slow warm-up step is a sixth of the evidence, and it must not send a
  host to share 0; later, the level median needs several slow steps.

  Every input is the timing vector that every host holds, and every
  computation is deterministic, so all hosts hold the same split
  (docs/design.md invariant 3). `decisions` logs each split with its predicted and
  then-measured step time (max host compute seconds).
  """

  def __init__(self, global_batch: int, num_hosts: int, granularity: Sequence[int] | None = None,
               mode: str = "dynamic", *, warmup_steps: int = 7, skip_steps: int = 1,
               every: int = 3, threshold: float = 0.05, max_move: float = 0.1,
               caps: Sequence[int] | None = None, window: int = 32, half_life: float = 3.0,
               prior_fixed_fraction: float = 0.1, start_step: int = 0, trust: float = 2.0,
               min_spread: float = 0.25, max_fixed_ratio: float = 2.0):
    if mode not in ("static", "dynamic"):
      raise ValueError(f"profiling mode must be 'static' or 'dynamic', got {mode!r}.")
    if global_batch < 1 or num_hosts < 1:
      raise ValueError(f"global batch and hosts must be >= 1, got {global_batch} and {num_hosts}.")
    granularity = [1] * num_hosts if granularity is None else [int(g) for g in granularity]
    if len(granularity) != num_hosts or min(granularity) < 1:
      raise ValueError(f"granularity needs one value >= 1 per host ({num_hosts} hosts), "
                       f"got {granularity}.")
    if warmup_steps < skip_steps + 1:
      raise ValueError(f"warmup_steps ({warmup_steps}) must exceed skip_steps ({skip_steps}): "
                       "the model needs at least one measured step.")
    if every < 1 or threshold < 0 or not 0 < max_move <= 1:
      raise ValueError(f"need every >= 1, threshold >= 0, 0 < max_move <= 1; got {every}, "
                       f"{threshold}, {max_move}.")
    if not trust > 1.0:
      raise ValueError(f"trust must be > 1 (how far beyond the shares a host ran a solve may "
                       f"move it), got {trust}.")
    self.trust = float(trust)
    self.name, self.mode = mode, mode
    self.global_batch, self.num_hosts = global_batch, num_hosts
    self.granularity = np.asarray(granularity, np.int64)
    self.caps = (np.full(num_hosts, global_batch, np.int64) if caps is None
                 else np.asarray(caps, np.int64))
    if len(self.caps) != num_hosts or int(np.minimum(self.caps, global_batch).sum()) < global_batch:
      raise ValueError(f"caps {list(map(int, self.caps))} must give one value per host and sum "
                       f"to at least the global batch {global_batch}.")
    self.warmup_steps, self.skip_steps, self.every = warmup_steps, skip_steps, every
    # Warm-up counts from here: a job resumed on another set of hosts profiles anew.
    self.start_step = int(start_step)
    self.threshold, self.max_move = threshold, max_move
    self.model = CostModel(num_hosts, granularity, window=window, half_life=half_life,
                           prior_fixed_fraction=prior_fixed_fraction, min_spread=min_spread,
                           max_fixed_ratio=max_fixed_ratio,
                           typical_share=global_batch / num_hosts)
    start = np.asarray(equal_split(global_batch, num_hosts))
    if (start > self.caps).any():
      start = _round_to_sum(global_batch * self.caps / self.caps.sum(), global_batch, self.caps)
    sign = np.where(np.arange(num_hosts) % 2 == 0, 0.5, -0.5)
    self._plan = [tuple(int(v) for v in start)] + [
        tuple(int(v) for v in _round_to_sum(start * (1 + s * sign), global_batch, self.caps))
        for s in (1, -1)]
    self._current = self._plan[0]
    self.decisions: list[dict[str, Any]] = []
    self._unmeasured: list[int] = []
    for phase, shares in enumerate(self._plan):
      self._log(self._phase_start(phase), shares, None,
                "warm-up: equal split" if phase == 0 else f"warm-up: probe {phase}")

  def _phase_start(self, phase: int) -> int:
    span = self.warmup_steps - self.skip_steps
    return self.start_step + self.skip_steps + -(-phase * span // 3)

  def _phase(self, step: int) -> int:
    return min(2, max(0, (step - self.skip_steps) * 3 // (self.warmup_steps - self.skip_steps)))

  def _log(self, step: int, shares: Sequence[int], predicted: float | None, reason: str) -> None:
    self.decisions.append({"step": step, "shares": tuple(shares), "predicted_s": predicted,
                           "measured_s": None, "reason": reason})
    self._unmeasured.append(len(self.decisions) - 1)

  def shares(self, step: int) -> tuple[int, ...]:
    if step - self.start_step < self.warmup_steps:
      return self._plan[self._phase(max(step - self.start_step, 0))]
    return self._current

  def predict(self, shares: Sequence[int]) -> np.ndarray:
    """Every host's predicted compute seconds for `shares` under the current fit."""
    return self.model.fit().predict(shares)

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    shares = tuple(int(s) for s in shares)
    times = np.asarray(compute_s, dtype=np.float64)
    if len(shares) != self.num_hosts or times.shape != (self.num_hosts,):
      raise ValueError(f"observe needs {self.num_hosts} shares and compute times, got "
                       f"{len(shares)} and {times.shape}.")
    for i in list(self._unmeasured):
      d = self.decisions[i]
      if step >= d["step"] and shares == d["shares"]:
        d["measured_s"] = float(times.max())
        self._unmeasured.remove(i)
    rel = step - self.start_step
    if rel >= self.skip_steps:
      self.model.observe(shares, times)
    if rel < self.warmup_steps - 1 or self.model.num_observations == 0:
      return
    since = rel - (self.warmup_steps - 1)
    if since == 0:
      self._first_solve(step)
    elif self.mode == "dynamic" and since % self.every == 0:
      self._resolve(step)

  def state_dict(self) -> dict[str, Any]:
    """Split, cost-model window and decision log: enough to continue identically."""
    return {"kind": self.mode, "global_batch": self.global_batch, "num_hosts": self.num_hosts,
            "granularity": self.granularity.tolist(), "start_step": self.start_step,
            "current": list(self._current), "model": self.model.state_dict(),
            "decisions": [dict(d, shares=list(d["shares"])) for d in self.decisions],
            "unmeasured": list(self._unmeasured)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    _check_state(state, kind=self.mode, global_batch=self.global_batch,
                 num_hosts=self.num_hosts, granularity=self.granularity.tolist())
    self.start_step = int(state["start_step"])
    self._current = tuple(int(v) for v in state["current"])
    self.model.load_state_dict(state["model"])
    self.decisions = [dict(d, shares=tuple(d["shares"])) for d in state["decisions"]]
    self._unmeasured = [int(i) for i in state["unmeasured"]]

  def trust_region(self, first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-host `(floors, caps)` a solve may use now: near the shares each host ran.

    Floors only for the `first` solve after warm-up, where one step is a sixth
    of the evidence; later the level median needs several slow steps anyway,
    and a host whose fixed cost dominates must be able to reach share 0.
    """
    # Padded shares of the last two re-solve periods (pylint: disable=protected-access)
    ran = self.model._x[-2 * self.every:]
    caps = np.minimum(self.caps, np.maximum(np.ceil(self.trust * ran.max(axis=0)),
                                            self.granularity)).astype(np.int64)
    # Whole micro-batches: half of one micro-batch costs as much as all of it.
    whole = np.floor(ran.min(axis=0) / self.trust / self.granularity) * self.granularity
    floors = np.minimum(whole if first else 0, caps).astype(np.int64)
    if int(caps.sum()) < self.global_batch or int(floors.sum()) > self.global_batch:
      return np.zeros(self.num_hosts, np.int64), self.caps  # Cannot hold B: no region.
    return floors, caps

  def _solve(self, params: CostParams, first: bool = False) -> tuple[int, ...]:
    floors, caps = self.trust_region(first)
    return solve(self.global_batch, params.fixed_s, params.per_sample_s, self.granularity,
                 caps, floors)

  def _first_solve(self, step: int) -> None:
    params = self.model.fit()
    target = self._solve(params, first=True)
    self._current = target
    self._log(step + 1, target, float(params.predict(target).max()),
              f"{self.mode}: first solve after warm-up")

  def _resolve(self, step: int) -> None:
    params = self.model.fit()
    target = self._solve(params)
    now = float(params.predict(self._current).max())
    best = float(params.predict(target).max())
    gain = (now - best) / now if now > 0 else 0.0
    # Dead band: the configured threshold, widened to 3 sigma of the noise in a
    # gain (the difference of two hosts' fitted levels), and on many hosts to
    # the bias of the largest of N noisy levels (about sqrt(2 ln N) sigma), so
    # noise never moves it.
    spread = max(3.0, 1.0 + math.sqrt(2.0 * math.log(self.num_hosts)))
    band = max(self.threshold, math.sqrt(2.0) * spread * self.model.level_error)
    if gain <= band:
      return
    cur, tgt = np.asarray(self._current), np.asarray(target)
    # Small predicted gains move slowly (noise may hide in them); a large one
    # (a host that really slowed down) may move as far as it promises.
    limit = max(1, int(max(self.max_move, gain) * self.global_batch))
    biggest = int(np.abs(tgt - cur).max())
    new, limited = tgt, False
    if biggest > limit:
      mix = cur + (tgt - cur) * (limit / biggest)
      new, limited = _round_to_sum(mix, self.global_batch, self.caps), True
    predicted = float(params.predict(new).max())
    if predicted >= now:
      return
    self._current = tuple(int(v) for v in new)
    self._log(step + 1, self._current, predicted,
              f"dynamic: predicted gain {gain:.1%} > dead band {band:.1%}"
              + (f", move limited to {limit} samples" if limited else ""))


def make_balancer(assignment: str | Sequence[int], global_batch: int, num_hosts: int, *,
                  mode: str | None = None, granularity: Sequence[int] | None = None,
                  **options: Any) -> Balancer:
  """Builds the balancer for `assignment` ('equal' or explicit shares) or `mode`.

  `mode` defaults to 'equal' or 'fixed' from `assignment`; 'static' and
  'dynamic' build a `ProfilingBalancer` (which starts from the equal split)
  with `granularity` and `options` (warmup_steps, every, threshold, ...).
  """
  if global_batch < 1:
    raise ValueError(f"global batch must be >= 1, got {global_batch}.")
  if isinstance(assignment, str):
    assignment = parse_assignment(assignment)
  if mode is None:
    mode = "equal" if assignment == "equal" else "fixed"
  if mode not in MODES:
    raise ValueError(f"unknown balancer mode {mode!r}; choose one of {', '.join(MODES)}.")
  if mode in ("static", "dynamic"):
    if assignment != "equal":
      raise ValueError(f"mode {mode!r} starts from the equal split and sizes shares itself; "
                       "pass assignment 'equal' instead of explicit shares.")
    return ProfilingBalancer(global_batch, num_hosts, granularity, mode, **options)
  if options:
    raise ValueError(f"options {sorted(options)} apply to 'static'/'dynamic' only, not {mode!r}.")
  if mode == "equal" or assignment == "equal":
    return FixedBalancer(equal_split(global_batch, num_hosts), name="equal")
  return FixedBalancer(validate_shares(np.asarray(assignment).tolist(), global_batch, num_hosts))


def taus_from_speeds(round_steps: int, step_s: Sequence[float]) -> tuple[int, ...]:
  """Local steps per round of the rounds modes: `tau_i = max(1, round(H * v_i / v_max))`.

  `v_i = 1 / step_s[i]` is host i's local steps per second; the fastest host
  runs `round_steps` (H). Shared by the trainer and the simulator.
  """
  step_s = np.asarray(step_s, np.float64)
  if not np.all(step_s > 0):
    raise ValueError(f"local step seconds must be > 0, got {step_s.tolist()}.")
  v = 1.0 / step_s
  return tuple(int(max(1, np.floor(round_steps * x / v.max() + 0.5))) for x in v)
