"""Augmentations whose randomness comes from the record, not from the reader.

An augmentation is `fn(batch, keys) -> batch`, `keys` from `example_keys`: every draw hashes
the key, so record `i` in epoch `e` is augmented alike on any host and split (invariant 1).
Opt-in: digits, the default dataset, trains best without it (a flipped 2 is not a 2).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from hetjax.input import shuffle

Batch = dict[str, np.ndarray]
Augment = Callable[[Batch, np.ndarray], Batch]
_CROP, _FLIP = np.uint64(0xC409), np.uint64(0xF119)  # One stream per kind of draw.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def example_keys(seed: int, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
  """One uint64 per example, a hash of (seed, epoch, global record index)."""
  epoch_part = shuffle.epoch_key(seed ^ 0xA5A5, epochs)
  return shuffle.mix64(epoch_part + np.asarray(indices).astype(np.uint64) * _GOLDEN)


def _draw(keys: np.ndarray, stream: np.uint64, high: int) -> np.ndarray:
  """Integers in `[0, high)`, one per key, independent across streams."""
  return (shuffle.mix64(keys ^ stream) % np.uint64(high)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class RandomCrop:
  """Pads `batch[key]` ([n, H, W, C]) with zeros and crops back to H x W.

  A picklable object, not a closure, so worker processes can run it.
  """

  padding: int = 1
  key: str = "x"

  def __post_init__(self):
    if self.padding < 1:
      raise ValueError(f"the crop needs padding >= 1, got {self.padding}.")

  def __call__(self, batch: Batch, keys: np.ndarray) -> Batch:
    x, p = batch[self.key], self.padding
    n, h, w = x.shape[:3]
    padded = np.pad(x, [(0, 0), (p, p), (p, p)] + [(0, 0)] * (x.ndim - 3))
    dy, dx = _draw(keys, _CROP, 2 * p + 1), _draw(keys, _CROP + np.uint64(1), 2 * p + 1)
    rows = (dy[:, None] + np.arange(h))[:, :, None]
    cols = (dx[:, None] + np.arange(w))[:, None, :]
    return {**batch, self.key: padded[np.arange(n)[:, None, None], rows, cols]}


@dataclasses.dataclass(frozen=True)
class RandomFlip:
  """Mirrors `batch[key]` ([n, H, W, ...]) left-right for half the examples."""

  key: str = "x"

  def __call__(self, batch: Batch, keys: np.ndarray) -> Batch:
    x = batch[self.key]
    mirror = (_draw(keys, _FLIP, 2) == 1).reshape((-1,) + (1,) * (x.ndim - 1))
    return {**batch, self.key: np.where(mirror, x[:, :, ::-1], x)}


@dataclasses.dataclass(frozen=True)
class Compose:
  """Applies `augments` in order, each with the same per-example keys."""

  augments: tuple[Augment, ...]

  def __call__(self, batch: Batch, keys: np.ndarray) -> Batch:
    for fn in self.augments:
      batch = fn(batch, keys)
    return batch


_NAMED = {"crop": RandomCrop, "flip": RandomFlip}


def parse(spec: str | None) -> Augment | None:
  """'crop,flip' (or 'crop:2' for padding 2) -> an augmentation; 'none' -> None."""
  if spec is None or spec.strip() in ("", "none"):
    return None
  parts = []
  for token in spec.split(","):
    name, _, arg = token.strip().partition(":")
    if name not in _NAMED:
      raise ValueError(f"unknown augmentation {name!r} in {spec!r}; choose from "
                       f"{', '.join(_NAMED)} (comma-separated), or 'none'.")
    if arg and (name != "crop" or not arg.isdigit()):
      raise ValueError(f"bad augmentation {token.strip()!r} in {spec!r}: only crop takes an "
                       "argument, a padding in pixels (e.g. crop:2).")
    parts.append(RandomCrop(int(arg)) if arg else _NAMED[name]())
  return Compose(tuple(parts))
