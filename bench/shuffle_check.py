"""Why hetjax keeps its own index shuffle instead of grain's: bijection, spread, cost.

Run from the repository root (needs grain: `pip install -e ".[bench]"`):

  .venv/bin/python bench/shuffle_check.py

For each dataset size it maps stream positions 0..2047 of one epoch through
grain's `index_shuffle` (what `grain.MapDataset.shuffle` calls per element)
and through `hetjax.input.shuffle.permute`, and prints how many sixteenths of the
range they land in (a good shuffle: all 16) and how many distinct indices
come out (a permutation: all 2048). It also times 4096 positions of an
ImageNet-size epoch (1,281,167 records) both ways, side by side.
"""

from __future__ import annotations

import time

import numpy as np

from hetjax.input import shuffle

try:  # grain's public face: `grain.experimental` (older releases: `grain.python.experimental`).
  from grain.experimental import index_shuffle
except ImportError:
  try:
    from grain.python.experimental import index_shuffle
  except ImportError as e:
    raise SystemExit(f"bench/shuffle_check.py compares against grain: pip install grain ({e}).")


def _grain(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
  return np.array([index_shuffle(int(i), max_index=n - 1, seed=seed, rounds=4)
                   for i in positions], dtype=np.float64)


def _ours(positions: np.ndarray, n: int, seed: int) -> np.ndarray:
  key = shuffle.epoch_key(seed, np.zeros(len(positions), np.int64))
  return shuffle.permute(positions, n, key).astype(np.float64)


def main() -> None:
  n, positions = 1_281_167, np.arange(4096)
  t0 = time.perf_counter()
  _grain(positions, n, 7)
  t1 = time.perf_counter()
  _ours(positions, n, 7)
  t2 = time.perf_counter()
  print(f"4096 positions of an ImageNet-size epoch: grain {(t1 - t0) * 1e3:.1f} ms, "
        f"hetjax {(t2 - t1) * 1e3:.1f} ms (shared CPU: compare within the row)")
  for bits in (32, 40, 62):
    size = 2**bits - 3
    for name, fn in (("grain", _grain), ("hetjax", _ours)):
      got = fn(np.arange(2048), size, 7)
      filled = int((np.histogram(got, bins=16, range=(0, size))[0] > 0).sum())
      print(f"n=2^{bits}-3 {name:>6}: positions 0..2047 land in {filled}/16 sixteenths of the "
            f"range, {len(set(got.tolist()))} distinct of 2048")


if __name__ == "__main__":
  main()
