"""Solver: the integer split that minimises the slowest host's predicted time. Pure numpy."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hetjax.balancer.cost import _MIN_PER_SAMPLE_S
from hetjax.balancer.ladder import Ladders, as_ladders

_TIE = 1e-9  # In top programs: a level's exact cost counts as reaching it.


def solve(global_batch: int, fixed_s: Sequence[float], per_sample_s: Sequence[float],
          granularity: Sequence[int] | None = None, caps: Sequence[int] | None = None,
          floors: Sequence[int] | None = None, *,
          ladders: Sequence[Any] | Ladders | None = None) -> tuple[int, ...]:
  """Integer shares `b_i`, `sum = B`, `floor_i <= b_i <= cap_i`, minimising `max_i t_i(b_i)`.

  The cost is `CostParams`' step function on each host's ladder. Bisection over
  the time T finds the smallest level at which the hosts' capacities (largest
  share each runs within T) hold B; the units beyond the level just below go
  to the hosts that reach it, lowest index first (floors only raise
  capacities, so it stays exact). O(N k) per step, about 60 steps.

  Exact with `k = 1`. A ladder's cost is not always rising, so the host that
  takes part of its step may land above the level: `_within_level` repairs
  it. Against brute force on random small ladders (tests/test_ladder.py) the
  split is optimal.

  Example:
    >>> solve(10, [0, 0], [1.0, 3.0], [1, 1])
    (8, 2)
  """
  f = np.maximum(np.asarray(fixed_s, dtype=np.float64), 0.0)
  p = np.maximum(np.asarray(per_sample_s, dtype=np.float64), _MIN_PER_SAMPLE_S)
  n = len(f)
  if granularity is None and ladders is not None:
    granularity = as_ladders(n, None, ladders).unit
  g = np.asarray([] if granularity is None else granularity, dtype=np.int64)
  if not (len(p) == len(g) == n) or n < 1:
    raise ValueError(f"solve needs one fixed, per-sample and granularity value per host; got "
                     f"{len(f)}, {len(p)} and {len(g)}.")
  if (g < 1).any():
    raise ValueError(f"granularity must be >= 1 sample per micro-batch, got {g.tolist()}.")
  lad = as_ladders(n, g.tolist(), ladders)
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
  capacity = _Capacity(f, p, lad, cap, low, global_batch)
  # (p x top work) x programs: with k = 1 the very product the solver always used.
  top_s = p * lad.top_work
  lo, hi = 0.0, float(np.max(np.where(cap > 0, f + top_s * (lad.work(cap) / lad.top_work), 0.0)))
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    # Levels closer than 1e-12 (relative) count as a tie.
    if not lo < mid < hi or hi - lo <= 1e-12 * hi:
      break
    if int(capacity(mid).sum()) >= global_batch:
      hi = mid
    else:
      lo = mid
  shares = _fill(global_batch, capacity, lo, hi)
  if not lad.trivial:
    shares = _within_level(global_batch, capacity, hi, shares)
  return tuple(int(v) for v in shares)


def _fill(global_batch: int, capacity: "_Capacity", lo: float, hi: float) -> np.ndarray:
  """Every host's capacity at `lo`, the rest up to its capacity at `hi`, lowest index first."""
  base = capacity(lo) if lo > 0 else capacity.low.copy()
  extra = capacity(hi) - base
  rest = global_batch - int(base.sum())
  before = np.cumsum(extra) - extra
  return base + np.clip(rest - before, 0, extra)


def _within_level(global_batch: int, capacity: "_Capacity", hi: float, shares: np.ndarray,
                  levels: int = 8) -> np.ndarray:
  """On ladders: shares within the level `hi`, else within the next level up.

  `_repair` moves a host whose share costs more than the level to its nearest
  share within it, the others making up the difference; failing that, every
  capacity at the level is cut back to B (`_reduce`); failing that, the next
  levels up. The best split seen is kept.
  """
  best, best_t = shares, float(np.max(capacity.predict(shares)))
  tries = [_repair(shares, hi, capacity)]
  for _ in range(levels):
    top = capacity(hi)
    tries.append(_reduce(top, int(top.sum()) - global_batch, hi, capacity))
    for shares in tries:
      if int(shares.sum()) != global_batch:
        continue
      if capacity.fits(hi, shares).all():
        return shares
      t = float(np.max(capacity.predict(shares)))
      if t < best_t:
        best, best_t = shares, t
    hi, tries = capacity.next_level(hi), []
    if not np.isfinite(hi) or hi >= best_t:
      break
  return best


def _reduce(shares: np.ndarray, excess: int, t: float, capacity: "_Capacity") -> np.ndarray:
  """Takes `excess` units off the hosts, highest index first, each to a share within `t`."""
  out = shares.copy()
  for i in range(len(out) - 1, -1, -1):
    if excess <= 0:
      break
    target = max(int(capacity.low[i]), int(out[i]) - excess)
    b = _least_within(i, target, int(out[i]), t, capacity)
    excess -= int(out[i]) - b
    out[i] = b
  return out


def _least_within(i: int, target: int, current: int, t: float, capacity: "_Capacity") -> int:
  """Host i's smallest share in `[target, current]` that runs within `t` (`current` does)."""
  if target <= 0:
    return 0
  unit = int(capacity.lad.unit[i])
  q = -(-target // unit)
  while (q - 1) * unit < current:
    probe = max(target, (q - 1) * unit + 1)
    if capacity.fits_one(t, i, probe):
      return min(probe, current)
    q += 1
  return current


class _Capacity:
  """The largest share each host can run within a time, on its ladder, within its caps."""

  def __init__(self, f: np.ndarray, p: np.ndarray, lad: Ladders, cap: np.ndarray,
               low: np.ndarray, batch: int):
    self.f, self.lad, self.cap, self.low, self.batch = f, lad, cap, low, int(batch)
    self.inv_top = 1.0 / (p * lad.top_work)  # Top programs per second.
    self.cols = np.arange(lad.rem.shape[1])
    # Below its floor's cost a host counts at its floor; on a ladder, at the
    # largest of its cheapest shares from the floor up (a floor share may cost
    # more than a larger one, which is then never worse to give it).
    self.clamp = low if lad.trivial else self._cheapest_from_floor()
    if int(self.clamp.sum()) > int(cap.sum()) or int(self.clamp.sum()) > self.batch:
      self.clamp = low  # Not every host can take its cheapest share: count the floors.

  def budget(self, t: float) -> np.ndarray:
    """Top programs each host can run within `t` (fractional)."""
    return (t - self.f) * self.inv_top

  def __call__(self, t: float, cap: np.ndarray | None = None,
               rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Per host (of `rows`), the largest share within `t`, at most `cap`, at least its floor."""
    cap = self.cap[rows] if cap is None else cap
    unit, k, rem = self.lad.unit[rows], self.lad.k[rows], self.lad.rem[rows]
    real = (t - self.f[rows]) * self.inv_top[rows]
    n_cap, r_cap = np.divmod(-(-cap // unit), k)
    top = np.maximum(np.floor(real + _TIE), 0.0).astype(np.int64)
    over = top >= n_cap
    top = np.where(over, n_cap, top)
    if rem.shape[1] == 1:
      r = np.zeros_like(top)
    else:
      # The longest remainder that fits what is left, below the cap's own remainder.
      limit = np.where(over, r_cap, k - 1)
      ok = (rem <= (real - top + _TIE)[:, None]) & (self.cols[None] <= limit[:, None])
      r = np.where(ok.any(axis=1), ok.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1), 0)
    return np.maximum(np.minimum((top * k + r) * unit, cap), self.clamp[rows])

  def _cheapest_from_floor(self) -> np.ndarray:
    """Per host, the largest share in `[floor, cap]` among those of least cost."""
    lad = self.lad
    q0 = -(-self.low // lad.unit)
    qc = -(-self.cap // lad.unit)
    # W(q + k) > W(q): the cheapest rounds lie within one ladder step of the floor.
    q = q0[:, None] + self.cols[None]
    ok = (self.cols[None] < lad.k[:, None]) & (q <= qc[:, None])
    n, r = np.divmod(q, lad.k[:, None])
    need = np.where(ok, n + np.take_along_axis(lad.rem, np.minimum(r, lad.rem.shape[1] - 1),
                                                 axis=1), np.inf)
    least = need <= need.min(axis=1, keepdims=True) + _TIE
    last = need.shape[1] - 1 - np.argmax(least[:, ::-1], axis=1)
    best = np.minimum((q0 + last) * lad.unit, self.cap)
    return np.where(self.low > 0, np.maximum(best, self.low), 0)

  def predict(self, shares: np.ndarray) -> np.ndarray:
    """Seconds of every host's share (0 for share 0)."""
    need = self.lad.work(shares) / self.lad.top_work
    return np.where(shares > 0, self.f + need / self.inv_top, 0.0)

  def next_level(self, t: float) -> float:
    """The least share cost of any host above `t`: the next level a split can reach."""
    lad, beta = self.lad, self.budget(t) + _TIE
    qc = -(-self.cap // lad.unit)
    # Per remainder r, the fewest top programs n with n + rem[r] above the budget.
    n = np.maximum(np.floor(beta[:, None] - lad.rem) + 1, 0.0)
    q = n * lad.k[:, None] + self.cols[None]
    ok = np.isfinite(lad.rem) & (q <= qc[:, None]) & (q >= 1)
    need = np.where(ok, n + lad.rem, np.inf).min(axis=1)
    return float(np.min(self.f + need / self.inv_top))

  def fits(self, t: float, shares: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Whether each host's (of `rows`) share runs within `t` (share 0 always does)."""
    shares = np.asarray(shares, np.int64)
    n, r = np.divmod(-(-shares // self.lad.unit[rows]), self.lad.k[rows])
    need = n + np.take_along_axis(self.lad.rem[rows], r[:, None], axis=1)[:, 0]
    real = (t - self.f[rows]) * self.inv_top[rows]
    return (shares == 0) | (need <= real + _TIE)

  def fits_one(self, t: float, host: int, share: int) -> bool:
    return bool(self.fits(t, np.array([share]), np.array([host]))[0])


def _repair(shares: np.ndarray, t: float, capacity: _Capacity) -> np.ndarray:
  """Moves a host whose share costs more than `t` to one within `t`, others making up the sum."""
  shares = shares.copy()
  for h in np.flatnonzero(~capacity.fits(t, shares)):
    moved = _move_down(shares, h, t, capacity)
    if moved is None:
      moved = _move_up(shares, h, t, capacity)
    if moved is not None:
      shares = moved
  return shares


def _move_down(shares: np.ndarray, h: int, t: float, capacity: _Capacity) -> np.ndarray | None:
  """Host h to its largest share within `t` below; the freed units to others within `t`."""
  out = shares.copy()
  out[h] = capacity(t, out[[h]], np.array([h]))[0]
  left = int(shares[h] - out[h])
  if left <= 0:
    return None
  # Hosts that could take some of it (within t), then each in turn what is left.
  room = capacity(t, np.minimum(out + left, capacity.cap)) - out
  takers = np.flatnonzero((room > 0) & capacity.fits(t, out))
  for i in takers[takers != h]:
    if left == 0:
      break
    take = int(capacity(t, np.minimum(out[[i]] + left, capacity.cap[[i]]), np.array([i]))[0] - out[i])
    if take > 0:
      out[i] += take
      left -= take
  return out if left == 0 else None


def _move_up(shares: np.ndarray, h: int, t: float, capacity: _Capacity) -> np.ndarray | None:
  """Host h to its smallest share within `t` above; the units taken from others within `t`."""
  lad, out = capacity.lad, shares.copy()
  unit = int(lad.unit[h])
  q = -(-int(out[h]) // unit)
  for _ in range(int(lad.k[h]) + 1):
    q += 1
    b = min(q * unit, int(capacity.cap[h]))
    if b <= out[h]:
      return None
    share = max((q - 1) * unit + 1, int(out[h]) + 1)
    if capacity.fits_one(t, h, share):
      out[h] = share
      break
  else:
    return None
  need = int(out[h] - shares[h])
  for i in np.flatnonzero(out > capacity.low):
    if need == 0:
      break
    if i == h:
      continue
    b = _least_within(int(i), max(int(capacity.low[i]), int(out[i]) - need), int(out[i]), t,
                      capacity)
    need -= int(out[i]) - b
    out[i] = b
  return out if need == 0 else None
