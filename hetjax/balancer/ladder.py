"""How a host runs a share, and what that costs in work units. Pure numpy.

A host runs its share of `b` units (blocks in the trainer, samples in the
simulator) in device rounds of `unit` units (one block per device). A program
of `j` blocks per device runs `j` rounds at once. A host's ladder is its
largest program `k` and smaller ones (default `k, k/2, ..., 1`, all compiled at
start): `q = ceil(b / unit)` rounds run as `q // k` full programs plus the
cheapest mix for `q % k`, so padding stays below one device round and no share
needs a new shape.

A share's time is a step function of `b`, not always rising: on 8, 4, 2, 1
seven rounds take three programs where eight take one. A share is *efficient*
when no larger share costs as little; the solver hands out efficient shares.

Work units: the one-round program costs `unit`, so with `k = 1` a share's work
is its padded size. A program of `j` rounds costs `j * unit` by default, or is
scaled from measured seconds (`Ladder.of(..., program_s=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np


def padded(shares: Sequence[int] | np.ndarray, granularity: Sequence[int] | np.ndarray) -> np.ndarray:
  """Units a host really computes: whole device rounds, the last one masked."""
  b = np.asarray(shares, dtype=np.int64)
  g = np.asarray(granularity, dtype=np.int64)
  return -(-b // g) * g


def halving(k: int) -> tuple[int, ...]:
  """The default ladder of program sizes: `k, k // 2, ..., 1` (no repeats)."""
  if int(k) < 1:
    raise ValueError(f"a device batch must be >= 1 block per device, got {k}.")
  sizes, j = [], int(k)
  while j >= 1:
    sizes.append(j)
    j //= 2
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class Ladder:
  """One host's programs: `sizes` (rounds each, descending, ending at 1) and their work.

  Attributes:
    unit: units per device round (the trainer: devices, in blocks; the
      simulator: devices x micro-batch, in samples).
    sizes: rounds per program, strictly descending, the last one 1.
    work: work units of one run of each program, `sizes[i] * unit` by default.
  """

  unit: int
  sizes: tuple[int, ...] = (1,)
  work: tuple[float, ...] | None = None

  def __post_init__(self):
    sizes = tuple(int(s) for s in self.sizes)
    if int(self.unit) < 1:
      raise ValueError(f"a device round must hold >= 1 unit (one block per device), got "
                       f"{self.unit}.")
    if not sizes or sizes[-1] != 1 or any(a <= b for a, b in zip(sizes, sizes[1:])):
      raise ValueError(f"ladder sizes must be strictly descending and end with 1 (e.g. 8, 4, 2, "
                       f"1), got {list(sizes)}.")
    work = (tuple(float(s * self.unit) for s in sizes) if self.work is None
            else tuple(float(w) for w in self.work))
    if len(work) != len(sizes) or not all(w > 0 and np.isfinite(w) for w in work):
      raise ValueError(f"ladder work needs one finite value > 0 per size {list(sizes)}, got "
                       f"{list(work)}.")
    object.__setattr__(self, "unit", int(self.unit))
    object.__setattr__(self, "sizes", sizes)
    object.__setattr__(self, "work", work)

  @classmethod
  def of(cls, unit: int, k: int = 1, program_s: Sequence[float] | None = None,
         sizes: Sequence[int] | None = None) -> "Ladder":
    """The ladder of a host running device batches of `k` blocks (default sizes `k, k/2, ..., 1`);
    `program_s`, seconds of each program, scaled so the one-round one costs `unit` (the
    cost model fits the level)."""
    sizes = halving(k) if sizes is None else tuple(int(s) for s in sizes)
    if sizes[0] != int(k):
      raise ValueError(f"ladder sizes {list(sizes)} must start at the device batch k = {k}.")
    if program_s is None:
      return cls(unit, sizes)
    t = [float(v) for v in program_s]
    if len(t) != len(sizes) or not all(v > 0 for v in t):
      raise ValueError(f"program_s needs one time > 0 per program size {list(sizes)}, got {t}.")
    return cls(unit, sizes, tuple(v / t[-1] * unit for v in t))

  @property
  def k(self) -> int:
    """The largest program: the device batch, in blocks per device."""
    return self.sizes[0]

  @property
  def remainder_work(self) -> np.ndarray:
    """`R[r]`, r < k: least work of exactly `r` rounds by the smaller programs."""
    return _remainder(self)[0]

  def decompose(self, rounds: int) -> dict[int, int]:
    """How many runs of each program size `rounds` device rounds take (sizes with none left out)."""
    rounds = int(rounds)
    if rounds < 0:
      raise ValueError(f"rounds must be >= 0, got {rounds}.")
    n, r = divmod(rounds, self.k)
    out = {self.k: n} if n else {}
    choice = _remainder(self)[1]
    while r > 0:
      s = int(choice[r])
      out[s] = out.get(s, 0) + 1
      r -= s
    return out

  def programs(self, share: int) -> dict[int, int]:
    """The programs a host runs for a share of `share` units: {blocks per device: runs}
    (exactly what the balancer prices)."""
    return self.decompose(-(-int(share) // self.unit))


@functools.lru_cache(maxsize=4096)
def _remainder(ladder: Ladder) -> tuple[np.ndarray, np.ndarray]:
  """Least work of `r` rounds (r < k) by the programs below k, and the first program taken."""
  k = ladder.k
  best, choice = np.full(k, np.inf), np.zeros(k, np.int64)
  best[0] = 0.0
  small = [(s, w) for s, w in zip(ladder.sizes, ladder.work) if s < k]
  for r in range(1, k):
    for s, w in small:  # Largest first: ties keep the fewer, larger programs.
      if s <= r and best[r - s] + w < best[r] - 1e-12 * w:
        best[r], choice[r] = best[r - s] + w, s
  return best, choice


class Ladders:
  """The ladders of every host as arrays: `rem[h, r]`, host h's remainder work in top programs
  (`inf` beyond its k), so one vectorised pass serves hosts whose k differ."""

  def __init__(self, ladders: Sequence[Ladder]):
    self._items = tuple(ladders)
    if not self._items:
      raise ValueError("ladders need at least one host.")
    self._arrays(self._items)

  @classmethod
  def ones(cls, units: Sequence[int]) -> "Ladders":
    """`k = 1` on every host, one device round of `units[h]`: built without per-host objects."""
    out = cls.__new__(cls)
    out._items = None
    out.unit = np.asarray(units, np.int64)
    if out.unit.ndim != 1 or not len(out.unit) or (out.unit < 1).any():
      raise ValueError(f"device rounds must be one value >= 1 per host, got {out.unit.tolist()}.")
    out.k = np.ones(len(out.unit), np.int64)
    out.top_work = out.unit.astype(np.float64)
    out.rem = np.zeros((len(out.unit), 1))
    out.efficient = np.ones((len(out.unit), 1), bool)
    out.trivial = True
    return out

  @property
  def items(self) -> tuple[Ladder, ...]:
    if self._items is None:
      self._items = tuple(Ladder(int(u)) for u in self.unit)
    return self._items

  def _arrays(self, items: Sequence[Ladder]) -> None:
    self.unit = np.array([l.unit for l in items], np.int64)
    self.k = np.array([l.k for l in items], np.int64)
    self.top_work = np.array([l.work[0] for l in items], np.float64)
    kmax = int(self.k.max())
    self.rem = np.full((len(items), kmax), np.inf)
    for h, l in enumerate(items):
      self.rem[h, :l.k] = l.remainder_work / l.work[0]
    # A remainder is efficient when no larger one up to the next full program costs as little.
    after = np.minimum.accumulate(self.rem[:, ::-1], axis=1)[:, ::-1]  # min over r' >= r
    nxt = np.concatenate([after[:, 1:], np.full((len(items), 1), np.inf)], axis=1)
    self.efficient = (self.rem < np.minimum(nxt, 1.0)) & np.isfinite(self.rem)
    # k = 1 with the default work: the work of a share is its padded size.
    self.trivial = kmax == 1 and bool(np.all(self.top_work == self.unit))

  def __len__(self) -> int:
    return len(self.unit)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Ladders) and self.items == other.items

  def work(self, shares: Sequence[int] | np.ndarray) -> np.ndarray:
    """Work units of every host's share (`shares[..., H]`)."""
    b = np.asarray(shares, np.int64)
    if self.trivial:
      return padded(b, self.unit).astype(np.float64)
    q = -(-b // self.unit)
    n, r = np.divmod(q, self.k)
    rem = np.take_along_axis(np.broadcast_to(self.rem, b.shape[:-1] + self.rem.shape),
                             r[..., None], axis=-1)[..., 0]
    return (n + rem) * self.top_work

  def round_down(self, shares: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per host, the largest efficient share <= `shares` (whole rounds, an efficient remainder)."""
    q = np.asarray(shares, np.int64) // self.unit
    if self.trivial:
      return q * self.unit
    n, r = np.divmod(q, self.k)
    ok = self.efficient & (np.arange(self.rem.shape[1])[None] <= r[:, None])
    r_best = self.rem.shape[1] - 1 - np.argmax(ok[:, ::-1], axis=1)
    return (n * self.k + r_best) * self.unit


def as_ladders(num_hosts: int, granularity: Sequence[int] | None = None,
               ladders: Sequence[Ladder] | Ladders | None = None) -> Ladders:
  """Every host's ladder: the given ones, or `k = 1` over `granularity` (one round each)."""
  if isinstance(ladders, Ladders):
    out = ladders
  elif ladders is not None:
    out = Ladders([l if isinstance(l, Ladder) else Ladder(**l) for l in ladders])
  else:
    g = [1] * num_hosts if granularity is None else [int(v) for v in granularity]
    out = Ladders.ones(g)
  if len(out) != num_hosts:
    raise ValueError(f"need one ladder per host ({num_hosts} hosts), got {len(out)}.")
  if granularity is not None and list(out.unit) != [int(v) for v in granularity]:
    raise ValueError(f"granularity {list(granularity)} differs from the ladders' device rounds "
                     f"{out.unit.tolist()}; give one or make them agree.")
  return out
