"""Evaluation: compiled once, streamed, and the exact mean (over two hosts: test_signals.py)."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetjax
from hetjax import models as zoo
from hetjax import mesh, step, trainer
from hetjax.input import data
from hetjax.training import evaluate


@pytest.mark.parametrize("n, weights", [(10, [1, 1, 1]), (7, [0, 5, 1]), (100, [0, 0]), (3, [1, 1, 1, 1, 1])])
def test_host_ranges_cover_the_split_once_in_order(n, weights):
  ranges = evaluate.host_ranges(n, weights)
  assert len(ranges) == len(weights) and ranges[0][0] == 0 and ranges[-1][1] == n
  assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(ranges, ranges[1:]))
  assert all(stop == start for (start, stop), w in zip(ranges, weights) if w == 0 and sum(weights))


class Counting:
  """10^7 records made on demand from their indices; remembers the largest request."""

  info = data.DatasetInfo("counting", "image", num_classes=10)

  def __init__(self, n):
    self.n, self.largest = n, 0

  def __len__(self):
    return self.n

  def __getitem__(self, indices):
    indices = np.asarray(indices)
    self.largest = max(self.largest, len(indices))
    return {"x": (indices % 10).astype(np.float32)}


def _linear_task():
  # Loss = w * x with w = 1, "small" = x < 5: on i % 10 the means are 4.5 and 0.5 exactly.
  return hetjax.from_functions(lambda rng, b: {"w": jnp.ones(())},
                               lambda p, b, rng: (p["w"] * b["x"], {"small": (b["x"] < 5).astype(jnp.float32)}))


def _params(task):
  hetjax.initialize()
  meshes = mesh.Meshes.create()
  state = step.init_state(task, optax.sgd(0.1), meshes, {"x": np.zeros(4, np.float32)}, 0)
  return meshes, state


def test_a_ten_million_record_split_streams_in_flat_memory_and_gives_the_exact_mean():
  task = _linear_task()
  meshes, state = _params(task)
  ev = evaluate.Evaluator(task, meshes, batch_per_device=1 << 16)
  source = Counting(10**7)
  tracemalloc.start()
  figures = ev.evaluate(state.params, state.model_state, source, [1])
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert figures == {"loss": 4.5, "small": 0.5}
  assert source.largest == 1 << 16
  # One batch is 256 KiB of float32; the whole split would be 40 MB.
  assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_evaluation_equals_the_plain_mean_and_compiles_once():
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))
  hetjax.initialize()
  tr = trainer.Trainer(task, optax.adam(1e-2), data.load("digits"),
                       trainer.TrainConfig(global_batch=32, microbatch=8))
  test = data.load("digits", "test")
  tr.fit(3)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  first = tr.evaluate(test, batch_size=64)  # 360 records: the last batch is padded.
  assert compiles, "the first evaluation compiles its program (else the listener hears nothing)"
  tr.fit(2)
  compiles.clear()
  second = tr.evaluate(test, batch_size=64)
  assert compiles == [], "a second evaluation must reuse the compiled program"
  batch = test[np.arange(len(test))]
  losses, metrics, _ = task.evaluation_loss()(tr.params(), {}, batch, jax.random.key(0))
  np.testing.assert_allclose(second["loss"], np.mean(losses), rtol=1e-5)
  np.testing.assert_allclose(second["accuracy"], np.mean(metrics["accuracy"]), rtol=1e-6)
  assert first != second


def test_the_progress_line_shows_an_evaluation_even_between_its_scheduled_lines():
  import io
  from hetjax.observe import progress
  out = io.StringIO()
  bar = progress.Progress(100, host_id=0, stream=out, every=10, tty=False)
  base = {"loss": 1.0, "samples_per_sec": 10.0, "step_s": 0.1, "shares": [2, 2], "emulated": False}
  for i in range(12):
    record = dict(base, step=i + 1, lr=1e-3)
    if i == 4:
      record["eval"] = {"loss": 0.5, "accuracy": 0.875}
    bar.update(record)
  lines = out.getvalue().splitlines()
  assert [line.split()[1] for line in lines] == ["5/100", "10/100"]
  assert "eval accuracy 0.8750" in lines[0] and "lr 0.001" in lines[0]
  assert "eval" not in lines[1]
