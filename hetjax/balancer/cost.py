"""Cost model: what a share costs on each host, fitted online and robustly. Pure numpy."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from hetjax.balancer.ladder import Ladders, as_ladders, padded  # noqa: F401 (padded: re-exported)

_MIN_PER_SAMPLE_S = 1e-12  # Keeps the solver's division finite for a degenerate fit.


@dataclasses.dataclass(frozen=True)
class CostParams:
  """Per-host `t_i(b) = fixed_i + per_sample_i * work_i(b)`, and `t_i(0) = 0` (no program;
  the collective it still joins is outside this model).

  `work_i(b)`: work units on host i's ladder (`ladder.py`); `ceil(b / g_i) * g_i` with `k = 1`.
  """

  fixed_s: np.ndarray
  per_sample_s: np.ndarray
  granularity: np.ndarray
  ladders: Ladders | None = None

  def work(self, shares: Sequence[int] | np.ndarray) -> np.ndarray:
    """Work units of every host's share."""
    if self.ladders is None:
      return padded(shares, self.granularity)
    return self.ladders.work(shares)

  def predict(self, shares: Sequence[int] | np.ndarray) -> np.ndarray:
    """Predicted local compute seconds of every host for `shares`."""
    x = self.work(shares)
    return np.where(np.asarray(shares) > 0, self.fixed_s + self.per_sample_s * x, 0.0)


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

  The model is `t_i(b) = a_i * (c_i + work_i(b))` (`work_i`: the share's work
  units on the host's ladder; padded(b) with `k = 1`): `a_i` is seconds per unit
  (the level, which moves when a host changes speed) and `c_i` the fixed cost
  counted in samples (the shape, which a speed change scales with it).
  - shape `c_i`: the weighted median of the shapes that pairs of observations
    give alone (`_update_shape`), so a minority of outliers cannot move it.
    Only pairs at most `pair_steps` apart whose padded shares differ by at
    least `min_spread` of the larger one (widened to 8 sigma of the noise, at
    most 0.6) count: a slope read off a 1 % share difference under 3 % noise
    once made a host look almost free (25.9x its optimal share at 1024
    simulated hosts). Bounded to `[0, max_fixed_ratio x max(B / N, largest
    share seen)]`: an overestimate makes the per-sample cost look small.
    Without spread the last shape is kept; before any, `prior_fixed_fraction`.
  - level `a_i`: recency-weighted median of `t / (c_i + padded(b))` (half-life
    `half_life` steps): one slow step has at most ~1/4 of the weight and cannot
    move a median, while a host that really slows down wins the median within
    about `half_life` steps.
  """

  def __init__(self, num_hosts: int, granularity: Sequence[int] | None = None, *, window: int = 32,
               half_life: float = 3.0, prior_fixed_fraction: float = 0.1,
               min_spread: float = 0.25, max_fixed_ratio: float = 2.0,
               typical_share: float | None = None, pair_steps: int = 6,
               ladders: Sequence[Any] | Ladders | None = None):
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
    self.ladders = as_ladders(num_hosts, granularity, ladders)
    self.granularity = self.ladders.unit
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
    # The window holds padded shares (the trust region reads them); the fit, their work.
    x, y = self.ladders.work(self._x.astype(np.int64)).astype(np.float64), self._y
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
    return CostParams(fixed_s=level * self._shape, per_sample_s=level, granularity=self.granularity,
                      ladders=None if self.ladders.trivial else self.ladders)

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
