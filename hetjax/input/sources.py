"""Random-access record sources held in memory or computed from the index.

A source has `len(source)`, `source.info` (a `DatasetInfo`) and
`source[indices] -> {name: array[len(indices), ...]}`, record `i` the same whatever else is in
`indices`, so each host reads exactly its slice (invariant 1).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import os
from typing import Mapping, Protocol, Sequence

import numpy as np

from hetjax.input import shuffle

Batch = dict[str, np.ndarray]
# name -> (shape of one record, dtype); a None dimension matches any size.
RecordSpec = Mapping[str, tuple[Sequence[int | None], np.dtype | str]]


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What a model needs to know about the data.

  Args:
    name: the dataset's name (in messages, checkpoints and the data order's seed).
    kind: "image", "tokens", or "custom" for a user's own arrays.
    num_classes: labels of a classification set (None: not one).
    vocab_size: tokens of a language-model set (None: not one).

  Example:
    >>> info = hetjax.DatasetInfo("blobs", "custom", num_classes=2)
    >>> info.kind, info.num_classes
    ('custom', 2)
  """

  name: str
  kind: str  # "image", "tokens", or "custom" for a user's own arrays
  num_classes: int | None = None
  vocab_size: int | None = None


class Source(Protocol):
  """What the sampler, the loader and the trainer read records through."""

  info: DatasetInfo

  def __len__(self) -> int: ...

  def __getitem__(self, indices: np.ndarray) -> Batch: ...


class ArraySource:
  """Records held in memory as equally long numpy arrays: what a `Trainer` reads.

  Every host holds the same records; each reads only the rows of its slice
  of every global batch (`source[indices]`).

  Example:
    >>> x = np.arange(12, dtype=np.float32).reshape(6, 2)
    >>> source = hetjax.ArraySource({"x": x, "y": np.arange(6) % 2},
    ...                             hetjax.DatasetInfo("pairs", "custom", num_classes=2))
    >>> len(source), source[np.array([4, 1])]["y"].tolist()
    (6, [0, 1])
  """

  def __init__(self, arrays: dict[str, np.ndarray], info: DatasetInfo | None = None):
    """Args:
      arrays: record field -> array, every array the same length (the records).
      info: what the model needs to know (default: a custom dataset named 'arrays').
    """
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


class SyntheticSource:
  """Any number of records computed from their index, none held in memory.

  Record `i`: i.i.d. uniform pixels (zero mean, unit variance) hashed from `(seed, i, pixel)`,
  labelled by a fixed random linear teacher: learnable, and 10^9 records cost nothing.
  """

  def __init__(self, size: int = 10**7, seed: int = 0, shape: Sequence[int] = (8, 8, 1),
               num_classes: int = 10, name: str = "synthetic_big"):
    if not 1 <= size <= shuffle.MAX_RECORDS // max(1, int(np.prod(shape))):
      raise ValueError(f"synthetic dataset {name!r}: size must be in [1, 2^62 / pixels], got {size}.")
    self.size, self.seed, self.shape = int(size), int(seed), tuple(int(d) for d in shape)
    self.info = DatasetInfo(name, "image", num_classes=num_classes)
    self._pixels = int(np.prod(self.shape))
    self._key = shuffle.mix64(np.array([self.seed % 2**64], np.uint64) ^ np.uint64(0x5EED))[0]
    # float64 logits summed in a fixed order: a label never depends on which
    # other records share the read (a BLAS kernel choice could flip a tie).
    self._teacher = np.random.default_rng(1234).standard_normal((self._pixels, num_classes))

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, indices: np.ndarray) -> Batch:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= self.size):
      raise IndexError(f"dataset {self.info.name!r} has {self.size} records; asked for indices "
                       f"{idx.min()}..{idx.max()}.")
    counters = idx.astype(np.uint64)[:, None] * np.uint64(self._pixels) + np.arange(
        self._pixels, dtype=np.uint64)
    bits = shuffle.mix64(counters ^ self._key) >> np.uint64(40)  # 24 uniform bits.
    x = (bits.astype(np.float32) * np.float32(2.0**-24) - np.float32(0.5)) * np.float32(12**0.5)
    logits = (x.astype(np.float64)[:, :, None] * self._teacher[None]).sum(axis=1)
    y = np.argmax(logits, axis=1).astype(np.int32)
    return {"x": x.reshape(len(idx), *self.shape), "y": y}


def digits(split: str = "train") -> ArraySource:
  """The 1,797 real 8x8 handwritten digits that ship inside scikit-learn.

  A fixed 80/20 split (permutation seed 0), pixels scaled to [0, 1].
  """
  table = digits_table()
  x = (table[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[..., None]
  y = table[:, -1].astype(np.int32)
  order = np.random.default_rng(0).permutation(len(y))
  cut = int(0.8 * len(y))
  idx = {"train": order[:cut], "test": order[cut:]}
  if split not in idx:
    raise ValueError(f"dataset 'digits' has splits 'train' and 'test', not {split!r}.")
  return ArraySource({"x": x[idx[split]], "y": y[idx[split]]},
                     DatasetInfo("digits", "image", num_classes=10))


def digits_table() -> np.ndarray:
  """scikit-learn's `digits.csv.gz` (64 pixels, then the label), read as `load_digits` does,
  without importing scikit-learn (it loads SciPy: 1.6 s of CPU in every emulated host)."""
  spec = importlib.util.find_spec("sklearn")  # Locates the package; runs none of it.
  path = None if spec is None or not spec.submodule_search_locations else os.path.join(
      list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
  if path is None or not os.path.exists(path):
    raise FileNotFoundError("dataset 'digits' is the copy inside scikit-learn, which is not "
                            "installed here: pip install scikit-learn, or choose another dataset.")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return np.loadtxt(f, delimiter=",")


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


# ---- Record checks --------------------------------------------------------


def record_spec(source: Source) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """`{name: (shape of one record, dtype)}`, read from the first record."""
  if len(source) == 0:
    raise ValueError(f"dataset {source.info.name!r} is empty; it needs at least one record.")
  return {k: (tuple(v.shape[1:]), v.dtype) for k, v in source[np.arange(1)].items()}


def _fits(shape: tuple[int, ...], want: Sequence[int | None]) -> bool:
  return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def check_records(source: Source, expected: RecordSpec, probes: int = 3) -> None:
  """Raises ValueError, before training, if records disagree with the model: the first, the
  last and `probes - 2` evenly spaced records' arrays against `expected`, e.g. `{"x": ((8, 8,
  1), "float32"), "y": ((), "int32")}` (a None dimension matches any size; extra arrays pass)."""
  name = source.info.name
  n = len(source)
  if n == 0:
    raise ValueError(f"dataset {name!r} is empty; it needs at least one record.")
  where = np.unique(np.linspace(0, n - 1, max(1, probes)).round().astype(np.int64))
  for i in where:
    record = source[np.array([i])]
    for key, (shape, dtype) in expected.items():
      if key not in record:
        raise ValueError(f"dataset {name!r} records have arrays {sorted(record)}, but the model "
                         f"needs {key!r}; rename the array or pick a dataset that has it.")
      got = record[key]
      if not _fits(tuple(got.shape[1:]), shape) or got.dtype != np.dtype(dtype):
        raise ValueError(f"dataset {name!r} record {i}: {key!r} has shape {tuple(got.shape[1:])} "
                         f"and dtype {got.dtype}, but the model expects shape {tuple(shape)} and "
                         f"dtype {np.dtype(dtype)}; rebuild the model for this data (or convert "
                         f"the dataset, e.g. resize or cast offline).")
