"""Global-batch sampling, host slices, and datasets by name.

Invariant 1: step `s`'s samples depend only on (dataset, seed, step). One global stream of
record indices, each epoch a keyed O(1)-memory permutation (`shuffle.py`); step `s` takes
positions `[s*B, (s+1)*B)` (batches may cross epochs); host `i` the contiguous slice
`[o_i, o_i + b_i)`. Sources (`sources.py`, `tfds_data.py`, `tokenfile.py`, `images.py`) are
re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hetjax.input import shuffle, tokenfile
from hetjax.input.sources import (ArraySource, Batch, DatasetInfo, Source, SyntheticSource,  # noqa: F401
                            check_records, digits, record_spec, synthetic_images,
                            synthetic_tokens)

SAMPLER_VERSION = 1  # Bump when the stream for a given (size, batch, seed) changes.


class GlobalSampler:
  """The split-independent stream of global batches."""

  def __init__(self, num_records: int, global_batch: int, seed: int, *, name: str | None = None):
    what = f"dataset {name!r}" if name else "the dataset"
    if global_batch < 1:
      raise ValueError(f"the global batch must be >= 1, got {global_batch}.")
    if num_records < global_batch:
      raise ValueError(f"{what} has {num_records} records, fewer than one global batch "
                       f"({global_batch}); lower `global_batch` or use a larger dataset.")
    if num_records > shuffle.MAX_RECORDS:
      raise ValueError(f"{what} has {num_records} records; the sampler handles up to 2^62.")
    self.num_records = int(num_records)
    self.global_batch = int(global_batch)
    self.seed = int(seed)

  def at(self, positions: np.ndarray) -> np.ndarray:
    """The record indices at global stream `positions` (int64, same shape)."""
    epochs, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.num_records)
    return shuffle.permute(offsets, self.num_records, shuffle.epoch_key(self.seed, epochs))

  def positions(self, step: int, part: slice = slice(None)) -> np.ndarray:
    """Stream positions of `step`'s batch elements `part` (default: all `B`)."""
    start, stop, _ = part.indices(self.global_batch)
    return step * self.global_batch + np.arange(start, max(start, stop), dtype=np.int64)

  def indices(self, step: int) -> np.ndarray:
    """The `B` global record indices of `step`, in batch order."""
    return self.at(self.positions(step))

  def epochs_completed(self, step: int) -> int:
    """Whole epochs completed after `step` steps (exact integer arithmetic)."""
    return step * self.global_batch // self.num_records

  def state_dict(self, step: int) -> dict[str, int]:
    """The data cursor for a checkpoint: the step plus what a restore must find unchanged
    (the stream is a function of size, batch and seed)."""
    return {"step": int(step), "position": int(step) * self.global_batch,
            "num_records": self.num_records, "global_batch": self.global_batch,
            "seed": self.seed, "version": SAMPLER_VERSION}

  def restore(self, state: Mapping[str, Any]) -> int:
    """The step to resume at; ValueError if the checkpoint's stream differs."""
    for key, mine, fix in (
        ("version", SAMPLER_VERSION, "resume with the hetjax version that wrote it"),
        ("num_records", self.num_records, "resume on the same dataset and split"),
        ("seed", self.seed, "resume with the same `seed`"),
        ("global_batch", self.global_batch, "resume with the same `global_batch`")):
      if int(state[key]) != mine:
        raise ValueError(f"the checkpoint's data cursor has {key}={int(state[key])} but this run has "
                         f"{key}={mine}; its sample order would not continue: {fix}.")
    if int(state["position"]) != int(state["step"]) * self.global_batch:
      raise ValueError(f"the checkpoint's data cursor is inconsistent (step {state['step']}, "
                       f"position {state['position']}); the checkpoint is damaged.")
    return int(state["step"])


def host_slice(shares: Sequence[int], host: int) -> slice:
  """Host `host`'s contiguous part `[o_i, o_i + b_i)` of a global batch."""
  start = int(sum(shares[:host]))
  return slice(start, start + int(shares[host]))


# ---- Datasets by name ------------------------------------------------------

TFDS_PREFIX = "tfds:"
TOKENFILE_PREFIX = tokenfile.PREFIX
SYNTHETIC_BIG_SIZE = 10**7
SYNTHETIC_BIG_TEST_SIZE = 10**4  # Small: the CLI evaluates the whole test split in memory.
_SPLITS = {"train": 0, "test": 1}  # Built-in split -> generator seed.


def _synthetic_big(split: str) -> SyntheticSource:
  size = SYNTHETIC_BIG_SIZE if split == "train" else SYNTHETIC_BIG_TEST_SIZE
  return SyntheticSource(size, seed=_SPLITS[split])


DATASETS: dict[str, Callable[..., Source]] = {
    "digits": digits, "synthetic": synthetic_images, "synthetic_big": _synthetic_big,
    "tokens": synthetic_tokens}


def check_dataset_name(name: str, data_dir: str | None = None, split: str = "train", *,
                       seq_len: int | None = None, token_dtype: str = "uint16",
                       vocab_size: int | None = None) -> None:
  """Cheap checks before JAX starts (no TFDS import); raises ValueError.

  `tfds:NAME`: prepared in `data_dir`, random-access, has `split`; `tokenfile:PATH`: whole
  `token_dtype` ids, one `seq_len` window at least; a built-in name: has `split` (no folder).
  """
  if name.startswith(TOKENFILE_PREFIX):
    tokenfile.check(name[len(TOKENFILE_PREFIX):], seq_len, token_dtype)
    if split != "train":
      raise ValueError(f"dataset {name} is one file, read as split 'train', not {split!r}; "
                       "evaluate on another file with its own --dataset tokenfile:PATH.")
    return
  if (seq_len is not None or vocab_size is not None) and name not in ("tokens",):
    raise ValueError(f"--seq-len and --vocab-size apply to token datasets (tokens, "
                     f"tokenfile:PATH), not {name!r}: drop them.")
  if name.startswith(TFDS_PREFIX):
    from hetjax.input import tfds_data
    tfds_data.check(name[len(TFDS_PREFIX):], split, data_dir)
    return
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}, "
                     "tfds:NAME for a TFDS dataset prepared in --data-dir, or tokenfile:PATH "
                     "for a flat file of token ids.")
  if split not in _SPLITS:
    raise ValueError(f"dataset {name!r} has splits 'train' and 'test', not {split!r}.")


def evaluation_split(name: str, data_dir: str | None = None) -> str | None:
  """The split to evaluate on: 'test', else 'validation' (ImageNet has no test labels), else None."""
  if name.startswith(TOKENFILE_PREFIX):
    return None
  if not name.startswith(TFDS_PREFIX):
    return "test"
  from hetjax.input import tfds_data
  info = tfds_data.check(name[len(TFDS_PREFIX):], "train", data_dir)
  splits = [s["name"] for s in info.get("splits", [])]
  return next((s for s in ("test", "validation") if s in splits), None)


def check_image_size(name: str, image_size: int | None) -> None:
  """`--image-size` is for TFDS image datasets only, and a sane size; raises ValueError."""
  if image_size is None:
    return
  if not name.startswith(TFDS_PREFIX):
    raise ValueError(f"--image-size applies to TFDS image datasets (tfds:NAME); the built-in "
                     f"dataset {name!r} has fixed-size records: drop --image-size.")
  from hetjax.input import images
  images.ImageRecipe(image_size)  # Raises on a size out of range.


def load(name: str, split: str = "train", data_dir: str | None = None, *,
         image_size: int | None = None, augment: str | None = None, seq_len: int | None = None,
         token_dtype: str = "uint16", vocab_size: int | None = None) -> Source:
  """A dataset by name: a built-in one, `tfds:NAME[:VERSION]` from `data_dir`, or `tokenfile:PATH`.

  Args:
    name: a built-in name or `tfds:NAME[/CONFIG][:VERSION]`.
    split: 'train', 'test', or for TFDS any split (slice) it has.
    data_dir: the TFDS data folder.
    image_size: TFDS images only: decode, crop and resize to this square
      size on the loader's workers (`hetjax.input.images`), as ImageNet needs.
    augment: with `image_size`: the training crop and flip ('crop,flip').
    seq_len: token datasets: tokens per record (`tokenfile:PATH` needs it).
    token_dtype: `tokenfile:PATH`'s ids, 'uint16' (nanoGPT's .bin) or 'uint32'.
    vocab_size: token datasets: the vocabulary (`tokenfile`: default the
      file's largest id + 1, found by one pass over it).
  """
  check_dataset_name(name, data_dir, split, seq_len=seq_len, token_dtype=token_dtype,
                     vocab_size=vocab_size)
  if name.startswith(TOKENFILE_PREFIX):
    check_image_size(name, image_size)
    return tokenfile.TokenFileSource(name[len(TOKENFILE_PREFIX):], seq_len, token_dtype, vocab_size)
  if name.startswith(TFDS_PREFIX):
    from hetjax.input import tfds_data
    return tfds_data.tfds_source(name[len(TFDS_PREFIX):], split, data_dir,
                                 image_size=image_size, augment=augment)
  check_image_size(name, image_size)
  if name in ("digits", "synthetic_big"):
    return DATASETS[name](split)
  tokens = {k: v for k, v in (("seq_len", seq_len), ("vocab_size", vocab_size)) if v is not None}
  return DATASETS[name](seed=_SPLITS[split], **tokens)
