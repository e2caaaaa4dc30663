"""When did the devices finish? Timed on a helper thread, so the loop never waits.

The balancer needs each host's local compute seconds. Blocking the training
loop on the local sums to time them would leave the devices idle while
Python prepares the reduction; instead a helper thread waits for readiness
and notes the time, and the loop reads the figure when it fetches that step's
results (after dispatching the next step), when the
devices have long finished that work.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax


class ReadyClock:
  """Notes, on one helper thread, the `time.perf_counter()` when arrays are ready.

  Example:
    >>> clock = ReadyClock()
    >>> done = clock.watch(sums)       # returns at once
    >>> ready_at = done.result()       # later: when `sums` was ready
  """

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-ready")

  def watch(self, arrays: Any) -> concurrent.futures.Future:
    """A future of the moment every array in the tree `arrays` is ready."""
    return self._pool.submit(_ready_at, arrays)

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def _ready_at(arrays: Any) -> float:
  jax.block_until_ready(arrays)
  return time.perf_counter()
