"""The profiling balancer (`static`, `dynamic`): shares sized from measured speeds. Pure numpy."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from hetjax.balancer.cost import CostModel, CostParams
from hetjax.balancer.ladder import Ladders, as_ladders
from hetjax.balancer.solver import solve
from hetjax.balancer.split import check_state, equal_split, round_to_sum


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

  Trust region (`trust_region`): the model is only known near shares a host
  has run, so a misfit costs at most one bounded step, never a pathological one.
  Ladders (one `Ladder` per host; default `k = 1` over `granularity`): shares
  are priced by the programs that run them, and handed out wasting no micro-batch.

  Inputs are the timing vector every host holds and every computation is
  deterministic, so all hosts hold the same split (invariant 3). `decisions`
  logs each split with its predicted and then-measured step time.
  """

  def __init__(self, global_batch: int, num_hosts: int, granularity: Sequence[int] | None = None,
               mode: str = "dynamic", *, warmup_steps: int = 7, skip_steps: int = 1,
               every: int = 3, threshold: float = 0.05, max_move: float = 0.1,
               caps: Sequence[int] | None = None, window: int = 32, half_life: float = 3.0,
               prior_fixed_fraction: float = 0.1, start_step: int = 0, trust: float = 2.0,
               min_spread: float = 0.25, max_fixed_ratio: float = 2.0,
               ladders: Sequence[Any] | Ladders | None = None):
    if mode not in ("static", "dynamic"):
      raise ValueError(f"profiling mode must be 'static' or 'dynamic', got {mode!r}.")
    if global_batch < 1 or num_hosts < 1:
      raise ValueError(f"global batch and hosts must be >= 1, got {global_batch} and {num_hosts}.")
    if granularity is None and ladders is not None:
      granularity = [int(v) for v in as_ladders(num_hosts, None, ladders).unit]
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
    self.ladders = as_ladders(num_hosts, granularity, ladders)
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
                           typical_share=global_batch / num_hosts, ladders=self.ladders)
    start = np.asarray(equal_split(global_batch, num_hosts))
    if (start > self.caps).any():
      start = round_to_sum(global_batch * self.caps / self.caps.sum(), global_batch, self.caps)
    sign = np.where(np.arange(num_hosts) % 2 == 0, 0.5, -0.5)
    self._plan = [tuple(int(v) for v in start)] + [
        tuple(int(v) for v in round_to_sum(start * (1 + s * sign), global_batch, self.caps))
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
            "granularity": self.granularity.tolist(), **self._ladder_state(),
            "start_step": self.start_step,
            "current": list(self._current), "model": self.model.state_dict(),
            "decisions": [dict(d, shares=list(d["shares"])) for d in self.decisions],
            "unmeasured": list(self._unmeasured)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    check_state(state, kind=self.mode, global_batch=self.global_batch,
                 num_hosts=self.num_hosts, granularity=self.granularity.tolist(),
                 **self._ladder_state())
    self.start_step = int(state["start_step"])
    self._current = tuple(int(v) for v in state["current"])
    self.model.load_state_dict(state["model"])
    self.decisions = [dict(d, shares=tuple(d["shares"])) for d in state["decisions"]]
    self._unmeasured = [int(i) for i in state["unmeasured"]]

  def _ladder_state(self) -> dict[str, Any]:
    """The ladders, in a checkpoint only where some host has k > 1 (older states stay valid)."""
    if self.ladders.trivial:
      return {}
    return {"ladders": [{"unit": l.unit, "sizes": list(l.sizes), "work": list(l.work)}
                        for l in self.ladders.items]}

  def trust_region(self, first: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-host `(floors, caps)` a solve may use now: near the shares each host ran.

    Caps: `trust` x the largest padded share of the last `2 * every` steps (at
    least one micro-batch). Floors `smallest / trust` only for the `first` solve,
    where one slow warm-up step is a sixth of the evidence and must not send a
    host to 0; later the level median needs several slow steps, and a host whose
    fixed cost dominates must be able to reach 0.
    """
    # Padded shares of the last two re-solve periods (pylint: disable=protected-access)
    ran = self.model._x[-2 * self.every:]
    caps = np.minimum(self.caps, np.maximum(np.ceil(self.trust * ran.max(axis=0)),
                                            self.granularity)).astype(np.int64)
    # Whole micro-batches: half of one micro-batch costs as much as all of it.
    whole = self.ladders.round_down(np.floor(ran.min(axis=0) / self.trust))
    floors = np.minimum(whole if first else 0, caps).astype(np.int64)
    if int(caps.sum()) < self.global_batch or int(floors.sum()) > self.global_batch:
      return np.zeros(self.num_hosts, np.int64), self.caps  # Cannot hold B: no region.
    return floors, caps

  def _solve(self, params: CostParams, first: bool = False) -> tuple[int, ...]:
    floors, caps = self.trust_region(first)
    return solve(self.global_batch, params.fixed_s, params.per_sample_s, self.granularity,
                 caps, floors, ladders=self.ladders)

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
      new, limited = self._limited_move(params, cur, tgt, limit), True
    predicted = float(params.predict(new).max())
    if predicted >= now:
      return
    self._current = tuple(int(v) for v in new)
    self._log(step + 1, self._current, predicted,
              f"dynamic: predicted gain {gain:.1%} > dead band {band:.1%}"
              + (f", move limited to {limit} samples" if limited else ""))

  def _limited_move(self, params: CostParams, cur: np.ndarray, tgt: np.ndarray,
                    limit: int) -> np.ndarray:
    """A split at most `limit` units from `cur` per host, toward `tgt`: a mix of the two with
    `k = 1`; with ladders the best split within the limit (a mix may fall between efficient shares)."""
    if not self.ladders.trivial:
      floors, caps = self.trust_region()
      low = np.maximum(floors, cur - limit)
      high = np.minimum(caps, cur + limit)
      if (low <= high).all() and low.sum() <= self.global_batch <= high.sum():
        return np.asarray(solve(self.global_batch, params.fixed_s, params.per_sample_s,
                                self.granularity, high, low, ladders=self.ladders))
    mix = cur + (tgt - cur) * (limit / int(np.abs(tgt - cur).max()))
    return round_to_sum(mix, self.global_batch, self.caps)
