"""Global-batch sampling, host slices and in-memory sources.

DESIGN.md invariant 1: the samples of step `s` depend only on (dataset, seed,
step). The sampler enumerates one global stream of indices (a fresh
permutation per epoch); step `s` takes positions `[s*B, (s+1)*B)` of that
stream, so batches may cross epoch boundaries. Host `i` then takes the
contiguous slice `[o_i, o_i + b_i)` of the step's `B` indices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a model needs to know about the data."""

  name: str
  kind: str  # "image", "tokens", or "custom" for a user's own arrays
  num_classes: int | None = None
  vocab_size: int | None = None


class ArraySource:
  """Records held in memory as equally long numpy arrays."""

  def __init__(self, arrays: dict[str, np.ndarray], info: DatasetInfo | None = None):
    info = info or DatasetInfo("arrays", "custom")
    if not arrays:
      raise ValueError(f"dataset {info.name!r} has no arrays; give at least one, e.g. {{'x': x}}.")
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
      raise ValueError(f"dataset {info.name!r}: arrays disagree on length: {lengths}.")
    self.arrays = arrays
    self.info = info

  def __len__(self) -> int:
    return len(next(iter(self.arrays.values())))

  def __getitem__(self, indices: np.ndarray) -> Batch:
    return {k: v[indices] for k, v in self.arrays.items()}


class GlobalSampler:
  """The split-independent stream of global batches."""

  def __init__(self, num_records: int, global_batch: int, seed: int):
    if num_records < global_batch:
      raise ValueError(f"the dataset has {num_records} records, fewer than one global batch "
                       f"({global_batch}); lower --global-batch or use a larger dataset.")
    self.num_records = num_records
    self.global_batch = global_batch
    self.seed = seed

  @functools.lru_cache(maxsize=4)
  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_records)

  def indices(self, step: int) -> np.ndarray:
    """The `B` global record indices of `step`, in batch order."""
    positions = step * self.global_batch + np.arange(self.global_batch)
    epochs, offsets = np.divmod(positions, self.num_records)
    out = np.empty(self.global_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
      sel = epochs == epoch
      out[sel] = self._permutation(int(epoch))[offsets[sel]]
    return out

  def epoch(self, step: int) -> float:
    """Epochs completed after `step` steps."""
    return step * self.global_batch / self.num_records


def host_slice(shares: Sequence[int], host: int) -> slice:
  """Host `host`'s contiguous part `[o_i, o_i + b_i)` of a global batch."""
  start = int(sum(shares[:host]))
  return slice(start, start + int(shares[host]))


# ---- In-memory datasets -------------------------------------------------


def digits(split: str = "train") -> ArraySource:
  """The 1,797 real 8x8 handwritten digits that ship inside scikit-learn.

  A fixed 80/20 split (permutation seed 0), pixels scaled to [0, 1].
  """
  from sklearn.datasets import load_digits  # Heavy import; only when asked.

  d = load_digits()
  x = (d.images.astype(np.float32) / 16.0)[..., None]
  y = d.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(y))
  cut = int(0.8 * len(y))
  idx = {"train": order[:cut], "test": order[cut:]}
  if split not in idx:
    raise ValueError(f"dataset 'digits' has splits 'train' and 'test', not {split!r}.")
  return ArraySource({"x": x[idx[split]], "y": y[idx[split]]},
                     DatasetInfo("digits", "image", num_classes=10))


def synthetic_images(size: int = 4096, seed: int = 0, shape=(8, 8, 1), num_classes: int = 10) -> ArraySource:
  """Gaussian images labelled by a fixed random linear teacher (learnable)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((size, *shape), dtype=np.float32)
  teacher = np.random.default_rng(1234).standard_normal((int(np.prod(shape)), num_classes))
  y = np.argmax(x.reshape(size, -1) @ teacher, axis=1).astype(np.int32)
  return ArraySource({"x": x, "y": y}, DatasetInfo("synthetic", "image", num_classes=num_classes))


def synthetic_tokens(size: int = 4096, seed: int = 0, seq_len: int = 16, vocab_size: int = 32) -> ArraySource:
  """Arithmetic progressions modulo the vocabulary: a sequence task an LM can learn."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, vocab_size, size=(size, 1))
  stride = rng.integers(1, 4, size=(size, 1))
  x = ((start + stride * np.arange(seq_len)) % vocab_size).astype(np.int32)
  return ArraySource({"x": x}, DatasetInfo("tokens", "tokens", vocab_size=vocab_size))


DATASETS = {"digits": digits, "synthetic": synthetic_images, "tokens": synthetic_tokens}


def load(name: str, split: str = "train") -> ArraySource:
  """A dataset by name; raises `ValueError` listing the known names."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}.")
  if name == "digits":
    return digits(split)
  seed = {"train": 0, "test": 1}.get(split)
  if seed is None:
    raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}.")
  return DATASETS[name](seed=seed)
