"""Augmentations whose randomness comes from the record, not from the reader.

An augmentation is `fn(batch, keys) -> batch`, `keys` one uint64 per example
from `example_keys(seed, epochs, indices)`. Every draw is a hash of that key,
so record `i` in epoch `e` is cropped and flipped the same way whichever host
reads it and whatever shares the balancer chose (DESIGN.md invariant 1).
Augmentation is opt-in: digits, the default dataset, trains best without it
(a flipped 2 is not a 2).

Example:
  >>> aug = parse("crop,flip")
  >>> batch = aug(batch, example_keys(seed=0, epochs=epochs, indices=indices))
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from hetjax import shuffle

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


def random_crop(padding: int = 1, key: str = "x") -> Augment:
  """Pads `batch[key]` ([n, H, W, C]) with zeros and crops back to H x W."""
  if padding < 1:
    raise ValueError(f"random_crop needs padding >= 1, got {padding}.")

  def crop(batch: Batch, keys: np.ndarray) -> Batch:
    x = batch[key]
    n, h, w = x.shape[:3]
    padded = np.pad(x, [(0, 0), (padding, padding), (padding, padding)] + [(0, 0)] * (x.ndim - 3))
    dy, dx = _draw(keys, _CROP, 2 * padding + 1), _draw(keys, _CROP + np.uint64(1), 2 * padding + 1)
    rows = (dy[:, None] + np.arange(h))[:, :, None]
    cols = (dx[:, None] + np.arange(w))[:, None, :]
    return {**batch, key: padded[np.arange(n)[:, None, None], rows, cols]}

  return crop


def random_flip(key: str = "x") -> Augment:
  """Mirrors `batch[key]` ([n, H, W, ...]) left-right for half the examples."""

  def flip(batch: Batch, keys: np.ndarray) -> Batch:
    x = batch[key]
    mirror = (_draw(keys, _FLIP, 2) == 1).reshape((-1,) + (1,) * (x.ndim - 1))
    return {**batch, key: np.where(mirror, x[:, :, ::-1], x)}

  return flip


def compose(augments: Sequence[Augment]) -> Augment:
  """Applies `augments` in order, each with the same per-example keys."""

  def run(batch: Batch, keys: np.ndarray) -> Batch:
    for fn in augments:
      batch = fn(batch, keys)
    return batch

  return run


_NAMED = {"crop": random_crop, "flip": random_flip}


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
    parts.append(random_crop(int(arg)) if arg else _NAMED[name]())
  return compose(parts)
