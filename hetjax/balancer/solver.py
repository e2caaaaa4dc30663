"""Solver: the integer split that minimises the slowest host's predicted time. Pure numpy."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hetjax.balancer.cost import _MIN_PER_SAMPLE_S


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
