"""One host's reader: its slice of each global batch, prefetched in parallel.

Step s+1's shares are known only after step s's reduction, so the trainer guesses (the shares
stay) and prefetches; `get` reuses what overlaps the actual slice and reads the rest. A wrong
guess costs time, never correctness: `get` equals `read(step, shares)`.

Reads run in threads (`workers=0`) or `spawn`ed processes (`workers=N`: JPEG decoding under the
GIL would serialise; forking after JAX's threads can deadlock, so scripts need
`if __name__ == "__main__":`). With threads, a slice faster than `inline_below_s` is read on
the calling thread (handing off a sub-ms read costs more: BUILD_NOTES.md "Decisions: input").
Pieces are keyed by global positions, so results never depend on the workers. Not grain: its
workers walk a fixed shard of a fixed order; a host's slice here changes size every step.

Example:
  >>> with HostLoader(source, sampler, host_id=1, augment=augment.parse("crop")) as loader:
  ...   batch = loader.get(step, shares)
  ...   loader.prefetch(step + 1, shares)
  ...   ... compute on batch ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import threading
import time
import weakref
from multiprocessing import shared_memory
from typing import Sequence

import numpy as np

from hetjax.input import augment as augment_lib
from hetjax.input import data as data_lib
from hetjax.input.sources import Batch, Source


# Records `[start, stop)` of `step`'s global batch, being read into `future`.
_Chunk = collections.namedtuple("_Chunk", "step start stop future")
_WORKER: tuple = ()  # (source, sampler, augment) inside a worker process.
_LOADER_IDS = itertools.count()
# The trainer's inline_below_s: in-memory slices read well under it, decoding sources do not.
INLINE_BELOW_S = 2e-3
_WATCHDOG_S = 0.5  # How often a worker checks that its host process is alive.


def _start_worker(source: Source, sampler: data_lib.GlobalSampler,
                  augment: augment_lib.Augment | None, parent: int) -> None:
  global _WORKER
  _WORKER = (source, sampler, augment)
  threading.Thread(target=_exit_with, args=(parent,), name="hetjax-worker-watchdog",
                   daemon=True).start()


def _exit_with(parent: int) -> None:
  """Ends this worker once its host process is gone, even after a SIGKILL."""
  while os.getppid() == parent:
    time.sleep(_WATCHDOG_S)
  os._exit(0)


def _read_in_worker(step: int, start: int, stop: int) -> Batch | tuple[str, list]:
  """A piece read in a worker, its arrays handed over in shared memory (pickled through the
  pipe they cost both processes copies, and the worker waits until the host drains them)."""
  batch = read_records(*_WORKER, step, start, stop)
  offsets = np.cumsum([0] + [-(-v.nbytes // 64) * 64 for v in batch.values()]).tolist()  # Aligned.
  room = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
  if any(v.dtype.hasobject for v in batch.values()) or (
      room is not None and room.f_bavail * room.f_frsize < 2 * offsets[-1]):
    return batch  # Pickled: objects, or a /dev/shm near full (Docker's 64 MB) would SIGBUS us.
  shm = shared_memory.SharedMemory(create=True, size=max(1, offsets[-1]))
  for v, offset in zip(batch.values(), offsets):
    np.ndarray(v.shape, v.dtype, shm.buf, offset)[...] = v
  shm.close()
  return shm.name, [(k, v.dtype, v.shape, o) for (k, v), o in zip(batch.items(), offsets)]


def _copy_rows(result: Batch | tuple[str, list], a: int, b: int, out: Batch, at: int,
               rows: int) -> None:
  """Rows `[a, b)` of a piece into `out[at:]` (arrays of `rows`, made on first use); a piece in
  shared memory is freed."""
  if not isinstance(result, dict):
    shm = shared_memory.SharedMemory(result[0])
    shm.unlink()  # The mapping stays until closed.
    try:
      return _copy_rows({k: np.ndarray(shape, dtype, shm.buf, offset)
                         for k, dtype, shape, offset in result[1]}, a, b, out, at, rows)
    finally:
      shm.close()
  for k, v in result.items():
    if k not in out:
      out[k] = np.empty((rows, *v.shape[1:]), v.dtype)
    out[k][at:at + b - a] = v[a:b]


def _free(future: concurrent.futures.Future) -> None:
  """Unlinks the shared memory of a piece that `get` did not read (one it read is gone)."""
  if not (future.cancelled() or future.exception() or isinstance(future.result(), dict)):
    with contextlib.suppress(FileNotFoundError):
      shared_memory.SharedMemory(future.result()[0]).unlink()


def default_workers() -> int:
  """Worker processes for decoding: the host's cores minus one (for the training loop)."""
  return max(0, (os.cpu_count() or 1) - 1)


def read_records(source: Source, sampler: data_lib.GlobalSampler,
                 augment: augment_lib.Augment | None, step: int, start: int, stop: int) -> Batch:
  """Records `[start, stop)` of `step`'s global batch as training sees them.

  Each example's randomness is keyed by (seed, epoch, global index): a source
  with `train_records(indices, keys)` (decoded images) draws its crops from
  the keys, and `augment` then runs on the batch with the same keys.
  """
  positions = sampler.positions(step, slice(start, stop))
  indices = sampler.at(positions)
  train_view = getattr(source, "train_records", None)
  if train_view is None and augment is None:
    return source[indices]
  keys = augment_lib.example_keys(sampler.seed, positions // sampler.num_records, indices)
  batch = source[indices] if train_view is None else train_view(indices, keys)
  return batch if augment is None else augment(batch, keys)


class HostLoader:
  """Reads host `host_id`'s records of each step, decoding ahead in parallel.

  Not itself thread-safe: call `get`, `prefetch` and `close` from one thread
  (the training loop). Errors raised while reading surface in `get` as the
  original exception.
  """

  def __init__(self, source: Source, sampler: data_lib.GlobalSampler, host_id: int, *,
               threads: int = 2, workers: int = 0, augment: augment_lib.Augment | None = None,
               min_chunk: int | None = None, inline_below_s: float = 0.0):
    """Args:
      source: random-access records.
      sampler: the global stream (decides which record sits where).
      host_id: this host's position in the shares.
      threads: background reader threads when `workers` is 0.
      workers: worker processes (0: read in threads); the slice is split
        among them. Decoding images needs processes to use the host's cores.
      augment: per-example augmentation (see `hetjax.input.augment`), or None.
      min_chunk: do not split a read into pieces smaller than this (default
        64 records for threads, 1 for worker processes).
      inline_below_s: with threads, read a slice on the calling thread when the fastest of
        the last 8 reads, per record, puts it under this many seconds (0: always in threads).
    """
    if (threads < 1 or workers < 0 or (min_chunk is not None and min_chunk < 1)
        or inline_below_s < 0):
      raise ValueError(f"HostLoader needs threads >= 1, workers >= 0, min_chunk >= 1 and "
                       f"inline_below_s >= 0, got threads={threads}, workers={workers}, "
                       f"min_chunk={min_chunk}, inline_below_s={inline_below_s}.")
    if len(source) != sampler.num_records:
      raise ValueError(f"dataset {source.info.name!r} has {len(source)} records but the sampler "
                       f"was built for {sampler.num_records}; build both from the same source.")
    self.source, self.sampler, self.host_id = source, sampler, host_id
    self.augment, self.workers = augment, workers
    # Four pieces per worker: the pool hands the next piece to whichever worker is free, so
    # photos of unequal cost still keep every worker busy until the slice is done.
    self.pieces = 4 * workers or threads
    self.min_chunk = min_chunk or (1 if workers else 64)
    self.inline_below_s = 0.0 if workers else inline_below_s
    # Seconds per record of the latest timed reads; their fastest is the estimate
    # (a read that a busy machine preempted says little about the source).
    self._record_s: collections.deque[float] = collections.deque(maxlen=8)
    self.stats = {"prefetched": 0, "read_on_demand": 0, "read_inline": 0}  # Records served each way.
    self._chunks: list[_Chunk] = []
    self.thread_prefix = f"hetjax-loader-{host_id}-{next(_LOADER_IDS)}"
    if workers:
      self._pool = concurrent.futures.ProcessPoolExecutor(
          workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
          initargs=(source, sampler, augment, os.getpid()))
    else:
      self._pool = concurrent.futures.ThreadPoolExecutor(threads, self.thread_prefix)
    self._closed = False
    # A forgotten loader still lets its threads go when collected.
    self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

  # ---- Public API ----------------------------------------------------------

  def read(self, step: int, shares: Sequence[int]) -> Batch:
    """This host's records of `step`, read synchronously (the reference)."""
    part = self._slice(shares)
    return self._read(step, part.start, part.stop)

  def prefetch(self, step: int, shares: Sequence[int]) -> None:
    """Starts reading this host's slice of `step` under `shares` (a guess); nothing is read
    twice, and `get` drops the rest, so memory stays about two steps' slices."""
    self._check_open()
    part = self._slice(shares)
    if not self._reads_inline(part.stop - part.start):
      self._cover(step, part.start, part.stop)

  def get(self, step: int, shares: Sequence[int]) -> Batch:
    """This host's records of `step` under `shares`, equal to `read(step, shares)`."""
    self._check_open()
    part = self._slice(shares)
    start, stop = part.start, part.stop
    self._drop(lambda c: c.step < step or (c.step == step and (c.stop <= start or c.start >= stop)))
    if not any(c.step == step for c in self._chunks) and self._reads_inline(stop - start):
      self.stats["read_inline"] += stop - start
      return self._read(step, start, stop)
    had, out = {id(c) for c in self._chunks}, {}
    try:
      for chunk, a, b in self._cover(step, start, stop):
        _copy_rows(chunk.future.result(), a - chunk.start, b - chunk.start, out, a - start,
                   stop - start)
        self.stats["prefetched" if id(chunk) in had else "read_on_demand"] += b - a
    finally:
      self._drop(lambda c: c.step <= step)
    return out or self._read(step, start, start)  # Empty: the right trailing shapes.

  def running(self) -> int:
    """This loader's live reader threads and worker processes (0 once closed)."""
    threads = sum(t.name.startswith(self.thread_prefix) for t in threading.enumerate())
    processes = getattr(self._pool, "_processes", None) or {}
    return threads + sum(p.is_alive() for p in list(processes.values()))

  def close(self) -> None:
    """Cancels pending reads and joins the threads and processes; safe to call twice."""
    if not self._closed:
      self._closed = True
      self._drop(lambda c: True)
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._finalizer.detach()

  def __enter__(self) -> HostLoader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- Internals -----------------------------------------------------------

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("this HostLoader is closed; make a new one to read again.")

  def _slice(self, shares: Sequence[int]) -> slice:
    if not 0 <= self.host_id < len(shares):
      raise ValueError(f"shares {tuple(shares)} have no entry for host {self.host_id}.")
    part = data_lib.host_slice(shares, self.host_id)
    if part.start < 0 or part.stop < part.start or part.stop > self.sampler.global_batch:
      raise ValueError(f"shares {tuple(shares)} give host {self.host_id} the slice "
                       f"[{part.start}, {part.stop}), outside the global batch of "
                       f"{self.sampler.global_batch}; shares must be >= 0 and sum to it.")
    return part

  def _reads_inline(self, records: int) -> bool:
    """Whether a slice of `records` is cheaper to read here than in a thread (the first
    read runs here, to be timed)."""
    return bool(self.inline_below_s) and (
        not self._record_s or min(self._record_s) * records < self.inline_below_s)

  def _read(self, step: int, start: int, stop: int) -> Batch:
    """Records `[start, stop)` of `step`'s global batch, read here (timed)."""
    t0 = time.perf_counter()
    batch = read_records(self.source, self.sampler, self.augment, step, start, stop)
    if stop > start:
      self._record_s.append((time.perf_counter() - t0) / (stop - start))
    return batch

  def _submit(self, step: int, start: int, stop: int) -> list[_Chunk]:
    """Reads `[start, stop)` in up to one piece per worker, in the background."""
    pieces = max(1, min(self.pieces, (stop - start) // self.min_chunk))
    cuts = np.linspace(start, stop, pieces + 1).round().astype(int)
    read = _read_in_worker if self.workers else self._read  # A worker holds its own source.
    chunks = [_Chunk(step, int(a), int(b), self._pool.submit(read, step, int(a), int(b)))
              for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    self._chunks.extend(chunks)
    return chunks

  def _cover(self, step: int, start: int, stop: int) -> list[tuple[_Chunk, int, int]]:
    """Chunks (reused or new) that together hold `[start, stop)`, in order."""
    mine = sorted((c for c in self._chunks if c.step == step and c.start < stop and c.stop > start),
                  key=lambda c: c.start)
    plan, cur = [], start
    while cur < stop:
      held = next((c for c in mine if c.start <= cur < c.stop), None)
      if held is not None:
        end = min(held.stop, stop)
        plan.append((held, cur, end))
      else:
        end = min([c.start for c in mine if c.start > cur] + [stop])
        plan.extend((c, c.start, c.stop) for c in self._submit(step, cur, end))
      cur = end
    return plan

  def _drop(self, which) -> None:
    """Forgets the chunks `which` selects: cancels those not yet started, frees the rest."""
    dropped = [c for c in self._chunks if which(c)]
    self._chunks = [c for c in self._chunks if c not in dropped]
    for chunk in dropped:
      if not chunk.future.cancel():
        chunk.future.add_done_callback(_free)
