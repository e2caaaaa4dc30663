"""A keyed permutation of `[0, n)` that costs O(1) memory, in numpy.

10^9 records must not cost 10^9 indices, so only the needed positions are mapped: a Feistel
network on `[0, 2^k)` (the smallest power of two >= max(n, 4)), cycle-walked (reapplied while
`>= n`) into `[0, n)`. A few dozen vectorised integer ops per output; `2^k < 2n` (n >= 3), so
under two rounds on average.

Example:
  >>> key = epoch_key(seed=0, epochs=np.zeros(5, np.int64))
  >>> sorted(permute(np.arange(5), 5, key))
  [0, 1, 2, 3, 4]
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4  # Luby-Rackoff: four rounds of a good round function make a strong permutation.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
MAX_RECORDS = 2**62  # Keeps every shift and sum inside uint64.


def mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser: a bijective, avalanching hash of uint64 values.

  Works on arrays (numpy wraps uint64 array arithmetic modulo 2^64 silently;
  scalars would warn), so callers pass arrays of at least one dimension.
  """
  x = np.asarray(x, dtype=np.uint64)
  x = x ^ (x >> _S30)
  x *= _M1
  x ^= x >> _S27
  x *= _M2
  return x ^ (x >> _S31)


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
# Per-round constants, reduced modulo 2^64 in Python so numpy never overflows a scalar.
_ROUND_SALTS = np.array([(0x9E3779B97F4A7C15 * (r + 1)) % 2**64 for r in range(_ROUNDS)], np.uint64)


def epoch_key(seed: int, epochs: np.ndarray) -> np.ndarray:
  """One uint64 shuffle key per element of `epochs`, for the stream of `seed`."""
  base = mix64(np.array([(int(seed) + 0x9E3779B97F4A7C15) % 2**64], np.uint64))
  return mix64((np.asarray(epochs).astype(np.uint64) * _GOLDEN) ^ base)


def _round_keys(key: np.ndarray) -> np.ndarray:
  """`[rounds, len(key)]` round keys, hashed once per distinct key."""
  distinct, where = np.unique(key, return_inverse=True)
  return mix64(distinct[None, :] + _ROUND_SALTS[:, None])[:, where.reshape(-1)]


def _feistel(y: np.ndarray, round_keys: np.ndarray, hi: int, lo: int) -> np.ndarray:
  """A bijection of `[0, 2^(hi+lo))`: rounds of (L, R) -> (R, L ^ F(R, key))."""
  mask_lo, mask_hi = np.uint64((1 << lo) - 1), np.uint64((1 << hi) - 1)
  s_lo, s_hi = np.uint64(lo), np.uint64(hi)
  for round_key in round_keys:
    right = y & mask_lo
    f = mix64(right ^ round_key)
    f &= mask_hi
    f ^= y >> s_lo
    y = (right << s_hi) | f
  return y


def permute(x: np.ndarray, n: int, key: np.ndarray) -> np.ndarray:
  """`pi_key(x)` (int64, `x`'s shape), a bijection of `[0, n)` per key, `n <= MAX_RECORDS`;
  `key`: uint64 keys broadcastable to `x` (`epoch_key`): equal keys give the same permutation,
  so one call may mix several epochs."""
  if not 1 <= n <= MAX_RECORDS:
    raise ValueError(f"can only shuffle 1 to 2^62 records, got n={n}.")
  x = np.asarray(x, dtype=np.int64)
  if x.size and (x.min() < 0 or x.max() >= n):
    raise ValueError(f"offsets must lie in [0, {n}); got min {x.min()}, max {x.max()}.")
  shape = x.shape
  y = x.reshape(-1).astype(np.uint64)
  key = np.broadcast_to(np.asarray(key, dtype=np.uint64), shape).reshape(-1)
  if not y.size:
    return x
  bits = max(2, (n - 1).bit_length())
  hi, lo = bits - bits // 2, bits // 2
  round_keys = _round_keys(key)
  y = _feistel(y, round_keys, hi, lo)
  walking = np.flatnonzero(y >= np.uint64(n))
  while walking.size:  # Cycle-walking: every cycle of the bijection meets [0, n).
    y[walking] = _feistel(y[walking], round_keys[:, walking], hi, lo)
    walking = walking[y[walking] >= np.uint64(n)]
  return y.astype(np.int64).reshape(shape)
