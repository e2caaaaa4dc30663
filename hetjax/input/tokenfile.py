"""A flat file of token ids (nanoGPT's `.bin`) as fixed windows: record `i` is tokens
`[i * seq_len, (i + 1) * seq_len)`, no overlap, a trailing partial window dropped.

Mapped per read: a held `np.memmap` keeps every touched page resident (nanoGPT remaps per
batch too); the source pickles as a path for the loader's workers.
"""

from __future__ import annotations

import os

import numpy as np

from hetjax.input.sources import Batch, DatasetInfo

PREFIX = "tokenfile:"
DTYPES = ("uint16", "uint32")
_SCAN_TOKENS = 1 << 24  # Tokens read per chunk when finding the largest id (32-64 MB).


def check(path: str, seq_len: int | None, token_dtype: str = "uint16") -> int:
  """The number of windows in `path`; ValueError naming the fix when it cannot be read as one."""
  if token_dtype not in DTYPES:
    raise ValueError(f"--token-dtype must be one of {', '.join(DTYPES)}, got {token_dtype!r}.")
  if not path:
    raise ValueError("tokenfile:PATH needs a path, e.g. --dataset tokenfile:data/train.bin.")
  if not os.path.isfile(path):
    raise ValueError(f"token file {path!r} does not exist (or is not a file); give the path of a "
                     "flat file of token ids, e.g. nanoGPT's train.bin.")
  if seq_len is None or seq_len < 2:
    raise ValueError(f"dataset tokenfile:{path} needs --seq-len >= 2 (the window length in "
                     f"tokens), got {seq_len}.")
  size, width = os.path.getsize(path), np.dtype(token_dtype).itemsize
  if size % width:
    raise ValueError(f"token file {path!r} has {size} bytes, not a multiple of {width} "
                     f"({token_dtype}); is --token-dtype right (uint16 or uint32)?")
  tokens = size // width
  if tokens < seq_len:
    raise ValueError(f"token file {path!r} holds {tokens} {token_dtype} tokens, fewer than one "
                     f"window of --seq-len {seq_len}; lower --seq-len.")
  return tokens // seq_len


def largest_id(path: str, token_dtype: str = "uint16") -> int:
  """The largest token id in `path`, read in chunks (O(1) memory, one pass over the file)."""
  dtype, top = np.dtype(token_dtype), 0
  with open(path, "rb") as f:
    while (chunk := np.fromfile(f, dtype, _SCAN_TOKENS)).size:
      top = max(top, int(chunk.max()))
  return top


class TokenFileSource:
  """Fixed-length windows of a flat token file, by global index, random access.

  Example:
    >>> np.arange(1000, dtype=np.uint16).tofile("train.bin")
    >>> source = TokenFileSource("train.bin", seq_len=64, vocab_size=1024)
    >>> len(source), source[np.array([2])]["x"][0, :3].tolist()
    (15, [128, 129, 130])
  """

  def __init__(self, path: str, seq_len: int, token_dtype: str = "uint16",
               vocab_size: int | None = None):
    """`path`: token ids back to back in native byte order; `token_dtype`: 'uint16' (up to
    65,536 ids, as GPT-2's) or 'uint32'; `vocab_size`: None reads the file once for its largest
    id (given, every read checks its ids against it)."""
    self.windows = check(path, seq_len, token_dtype)
    self.path, self.seq_len, self.dtype = path, int(seq_len), np.dtype(token_dtype)
    if vocab_size is None:
      vocab_size = largest_id(path, token_dtype) + 1
    if vocab_size < 1:
      raise ValueError(f"--vocab-size must be >= 1, got {vocab_size}.")
    self.info = DatasetInfo(f"{PREFIX}{os.path.basename(path)}", "tokens", vocab_size=int(vocab_size))

  def __len__(self) -> int:
    return self.windows

  def __getitem__(self, indices: np.ndarray) -> Batch:
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= self.windows):
      raise IndexError(f"{self.path!r} has {self.windows} windows of {self.seq_len} tokens; "
                       f"asked for windows {idx.min()}..{idx.max()}.")
    tokens = np.memmap(self.path, self.dtype, mode="r", shape=(self.windows * self.seq_len,))
    x = tokens.reshape(self.windows, self.seq_len)[idx].astype(np.int32)
    del tokens  # Unmapped here: the touched pages leave this process's resident set.
    if x.size and int(x.max()) >= self.info.vocab_size:
      row = int(np.argmax(x.max(axis=1)))
      raise ValueError(f"{self.path!r} window {int(idx[row])} holds token id {int(x[row].max())}, "
                       f"not below --vocab-size {self.info.vocab_size}; raise --vocab-size or "
                       "check --token-dtype.")
    return {"x": x}
