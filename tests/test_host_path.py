"""The step's host path: what a step sends and times besides the model's work.

Reads cheaper than a thread hand-over run on the calling thread; the mask,
positions and host vector ride in one small array per micro-batch; work
already done when watched is timed without waking the readiness thread.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetjax
from hetjax import mesh, step
from hetjax.step import local as local_step
from hetjax.input import data
from hetjax.input import loader
from hetjax.training import readiness
from hetjax.input import sources
from hetjax.task import MASK


class _RecordedClock:
  """`time` as the loader sees it: only a read's recorded delay moves `perf_counter`.

  A read of `_Paced` takes exactly its `delay_s` on this clock (a little more
  when reads overlap in threads: each sees the others' delays too), and
  nothing sleeps, so which side of `inline_below_s` a read falls on never
  depends on the machine's load. Everything but `perf_counter` is the real
  `time` (the loader's watchdog sleeps for real).
  """

  def __init__(self):
    self.now, self._lock = 0.0, threading.Lock()

  def perf_counter(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    with self._lock:
      self.now += seconds

  def __getattr__(self, name):
    return getattr(time, name)


class _Paced(sources.ArraySource):
  """Numbered records whose reads take `delay_s` (changeable mid-run), on `clock` if given."""

  def __init__(self, n: int, clock: _RecordedClock | None = None):
    super().__init__({"i": np.arange(n), "x": np.arange(n, dtype=np.float32)[:, None]},
                     sources.DatasetInfo("paced", "custom"))
    self.delay_s, self.clock = 0.0, clock

  def __getitem__(self, indices):
    if self.delay_s:
      self.clock.advance(self.delay_s) if self.clock else time.sleep(self.delay_s)
    return super().__getitem__(indices)


def test_cheap_reads_run_inline_slow_ones_in_threads_and_the_records_never_differ(monkeypatch):
  clock = _RecordedClock()
  monkeypatch.setattr(loader, "time", clock)  # The loader times its reads on `clock`.
  source = _Paced(200, clock)
  sampler = data.GlobalSampler(200, 32, seed=3)
  # On the recorded clock a plain read takes 0 s and a paced one 0.3 s (or
  # more): either side of the line (0.1 s), whatever the load.
  with loader.HostLoader(source, sampler, 1, min_chunk=4, inline_below_s=0.1) as host:
    source.delay_s = 0.3
    host.prefetch(0, (8, 16, 8))  # Nothing timed yet: nothing is prefetched ...
    first = host.get(0, (8, 16, 8))  # ... the first read runs here and is timed.
    assert host.stats == {"prefetched": 0, "read_on_demand": 0, "read_inline": 16}
    host.prefetch(1, (8, 16, 8))  # Timed slow: now read ahead in threads.
    assert host.running() >= 1
    second = host.get(1, (8, 16, 8))
    assert host.stats == {"prefetched": 16, "read_on_demand": 0, "read_inline": 16}
    source.delay_s = 0.0  # Reads got cheap: the threads time them and hand back.
    host.prefetch(2, (8, 16, 8))
    host.get(2, (8, 16, 8))
    host.prefetch(3, (8, 16, 8))
    third = host.get(3, (8, 16, 8))
    assert host.stats["read_inline"] == 32 and host.stats["prefetched"] == 32
    for s, got in [(0, first), (1, second), (3, third)]:
      np.testing.assert_array_equal(got["i"], sampler.indices(s)[8:24])
      np.testing.assert_array_equal(got["x"][:, 0], sampler.indices(s)[8:24])


def test_the_default_loader_and_worker_processes_never_read_inline():
  sampler = data.GlobalSampler(50, 16, seed=0)
  with loader.HostLoader(_Paced(50), sampler, 0, min_chunk=4) as host:
    host.prefetch(0, (16,))
    host.get(0, (16,))
    assert host.stats["read_inline"] == 0 and host.stats["prefetched"] == 16
  with pytest.raises(ValueError, match="inline_below_s >= 0"):
    loader.HostLoader(_Paced(50), sampler, 0, inline_below_s=-1.0)


def test_the_trainer_reads_cheap_records_inline():
  source = data.synthetic_images(size=64)
  task = hetjax.from_functions(
      lambda rng, batch: {"w": jnp.zeros((8 * 8 * 1, 10))},
      lambda p, batch, rng: (optax.softmax_cross_entropy_with_integer_labels(
          batch["x"].reshape(len(batch["x"]), -1).astype(jnp.float32) @ p["w"], batch["y"]), {}))
  trainer = hetjax.Trainer(task, optax.sgd(0.1), source,
                           hetjax.TrainConfig(global_batch=16, microbatch=8, check_every=0))
  trainer.fit(3)
  trainer.close()
  assert trainer.mode.loader.stats["read_inline"] > 0


def test_position_rows_give_each_device_its_block_its_real_count_and_the_host_vector():
  host = np.array([0.25, -3.0, 7.0], np.float32)
  rows = local_step._position_rows(step=9, first_block=4, first=True, real=6, per_device=4,
                                   devices=3, host_values=host)
  assert rows.dtype == np.int32 and rows.shape == (3, local_step._POSITION_FIELDS + 3)
  np.testing.assert_array_equal(rows[:, :4], [[9, 4, 1, 4], [9, 5, 1, 2], [9, 6, 1, 0]])
  for r in rows:
    np.testing.assert_array_equal(r[4:].view(np.float32), host)


def test_the_sums_carry_the_host_vector_and_the_mask_built_on_the_device():
  """A masked sum over a padded micro-batch equals the sum over its real rows."""
  meshes = mesh.Meshes.create()

  def loss(params, batch, rng):
    del rng
    return batch["x"][:, 0] * params["w"], {}

  task = hetjax.from_functions(lambda rng, batch: {"w": jnp.ones(())}, loss)
  source = {"x": np.arange(1, 8, dtype=np.float32)[:, None]}  # 7 rows: one micro-batch of 4 padded.
  optimizer = optax.sgd(0.1)
  state = mesh.to_local_tree(step.init_state(
      task, optimizer, meshes,
      next(step.micro_batches({k: v[:1] for k, v in source.items()}, 4)), 0), meshes)
  local = step.LocalProgram(task, optimizer, meshes, 4)
  host = np.array([1.5, 2.5], np.float32)
  sums = local(state, None, source, {k: v[:1] for k, v in source.items()},
               jax.random.key(0), 0, host_values=host).sums
  totals = sums.totals()
  assert float(totals.count) == 7 and float(totals.loss) == 28.0  # 1 + ... + 7, padding masked.
  np.testing.assert_array_equal(sums.host_values(), host)
  empty = local(state, None, {k: v[:0] for k, v in source.items()},
                {k: v[:1] for k, v in source.items()}, jax.random.key(0), 1,
                host_values=host * 2).sums
  assert float(empty.totals().count) == 0
  np.testing.assert_array_equal(empty.host_values(), host * 2)
  with pytest.raises(ValueError, match="host_values has 3 values; this program was built for 2"):
    local(state, None, source, {k: v[:1] for k, v in source.items()},
          jax.random.key(0), 2, host_values=np.zeros(3))


def test_work_done_when_watched_is_timed_without_the_thread():
  clock = readiness.ReadyClock()
  try:
    x = jax.block_until_ready(jnp.arange(3.0) * 2)
    before = time.perf_counter()
    done = clock.watch(1.25, x)
    assert done.done()  # Resolved on the calling thread.
    known, ready_at = done.result()
    assert known == 1.25 and ready_at >= before
    assert readiness.ready_now(x) is not None
    later = clock.watch(x, {"y": x}).result(timeout=10)
    assert later[0] <= later[1]
  finally:
    clock.close()


def test_deferred_work_is_stamped_when_the_loop_looks():
  on_loop, threaded = readiness.ReadyClock(on_loop=True), readiness.ReadyClock()
  try:
    x = jax.block_until_ready(jnp.arange(3.0) + 1)
    pending = on_loop.defer(x, {"y": x})
    before = time.perf_counter()
    pending.look()  # Done by now: both stamped here, in order, no thread.
    after = time.perf_counter()
    first, second = pending.result()
    assert before <= first <= second <= after
    pending.look()  # Looking again changes nothing.
    assert pending.result() == (first, second)
    waited = on_loop.defer(x)
    assert before <= waited.result()[0]  # Nobody looked: stamped by waiting.
    looked = threaded.defer(x)
    looked.look()  # Handed to the clock, which finds it done.
    assert before <= looked.result()[0]
  finally:
    on_loop.close()
    threaded.close()
