"""When did the devices finish? Timed without making the loop wait for them.

Blocking the loop to time the local sums would idle the devices while Python
prepares the reduction. So on an accelerator a helper thread waits and notes
the time, exactly (`ReadyClock()`); on XLA:CPU, whose devices are the loop's
own cores, waking a thread costs a short step more than the timing is worth,
so the loop stamps a stage when it sees it done at points it passes anyway
(`on_loop=True`): an upper bound, off by at most the loop's work between two
looks. The loop reads the figures when it fetches that step's results.
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


def ready_at(arrays: Any) -> float:
  """Waits for every array in the tree; the `time.perf_counter()` when they were ready."""
  return _ready_at((arrays,))[0]


class ReadyClock:
  """Notes the `time.perf_counter()` when arrays are ready, without making the loop wait."""

  def __init__(self, on_loop: bool = False):
    self.on_loop = on_loop
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-ready")

  def watch(self, *stages: Any) -> concurrent.futures.Future:
    """A future of the moments each stage (a tree of arrays, or a float: known) was ready;
    resolved here, no thread woken, when every stage is known or ready now."""
    if all(isinstance(s, float) or ready_now(s) is not None for s in stages):
      done = concurrent.futures.Future()
      done.set_result(_ready_at(stages))
      return done
    return self._pool.submit(_ready_at, stages)

  def defer(self, *stages: Any) -> "Pending":
    """The stages' moments, stamped by `Pending.look` and `result`."""
    return Pending(self, stages)

  def close(self) -> None:
    self._pool.shutdown(wait=True)


class Pending:
  """A step's stages (each depends on the one before), stamped as the clock's backend allows."""

  def __init__(self, clock: ReadyClock, stages: tuple[Any, ...]):
    self._clock, self._stages = clock, list(stages)
    self._future: concurrent.futures.Future | None = None

  def look(self) -> None:
    """On the loop: stamps the stages done by now, in order (waits for nothing); otherwise
    hands them to the clock's thread, once."""
    if self._future is not None:
      return
    if not self._clock.on_loop:
      self._future = self._clock.watch(*self._stages)
      return
    for i, stage in enumerate(self._stages):
      if not isinstance(stage, float):
        now = ready_now(stage)
        if now is None:
          return
        self._stages[i] = now

  def result(self) -> tuple[float, ...]:
    """The moments each stage was ready, in order (on the loop, what no look stamped is
    waited for here: usually done, as the loop already holds the results)."""
    if self._future is None:
      if self._clock.on_loop:
        self._stages = [s if isinstance(s, float) else ready_at(s) for s in self._stages]
      self._future = self._clock.watch(*self._stages)
    return self._future.result()


def _ready_at(stages: tuple[Any, ...] | list[Any]) -> tuple[float, ...]:
  times = []
  for stage in stages:
    if not isinstance(stage, float):
      jax.block_until_ready(stage)
      stage = time.perf_counter()
    times.append(stage)
  return tuple(times)
