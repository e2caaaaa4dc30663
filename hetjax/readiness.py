"""When did the devices finish? Timed on a helper thread, so the loop never waits.

The balancer needs each host's local compute seconds. Blocking the training
loop on the local sums to time them would leave the devices idle while
Python prepares the reduction; instead a helper thread waits for readiness
and notes the time, and the loop reads the figure when it fetches that step's
results (after dispatching the next step), when the
devices have long finished that work.

Work that is already done when it is watched (XLA:CPU runs small programs
inside the dispatch call) is timed on the calling thread: waking the helper
thread for it cost a short step more than the timing is worth.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import jax


def ready_now(arrays: Any) -> float | None:
  """`time.perf_counter()` if every array in the tree is ready now, else None."""
  if all(x.is_ready() for x in jax.tree.leaves(arrays)):
    return time.perf_counter()
  return None


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
    """A future of the moments each stage (a tree of arrays) was ready, in order.

    A stage may be a float: a moment already known (from `ready_now`).
    When every stage is ready now, the future is resolved here, no thread woken.
    """
    if all(isinstance(s, float) or ready_now(s) is not None for s in stages):
      done = concurrent.futures.Future()
      done.set_result(_ready_at(stages))
      return done
    return self._pool.submit(_ready_at, stages)

  def close(self) -> None:
    self._pool.shutdown(wait=True)


def _ready_at(stages: tuple[Any, ...]) -> tuple[float, ...]:
  times = []
  for stage in stages:
    if not isinstance(stage, float):
      jax.block_until_ready(stage)
      stage = time.perf_counter()
    times.append(stage)
  return tuple(times)
