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

  One submission per step (each one wakes the thread, which then competes
  with the loop for the GIL), however many stages it times.

  Example:
    >>> clock = ReadyClock()
    >>> done = clock.watch(sums, update)      # returns at once
    >>> sums_at, update_at = done.result()    # later: when each was ready
  """

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-ready")

  def watch(self, *stages: Any) -> concurrent.futures.Future:
    """A future of the moments each stage (a tree of arrays) was ready, in order."""
    return self._pool.submit(_ready_at, stages)

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def _ready_at(stages: tuple[Any, ...]) -> tuple[float, ...]:
  times = []
  for arrays in stages:
    jax.block_until_ready(arrays)
    times.append(time.perf_counter())
  return tuple(times)
