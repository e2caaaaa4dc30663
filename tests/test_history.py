"""Bounded history: memory O(1) in steps, every record still emitted, totals exact."""

import numpy as np
import optax
import pytest

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data
from hetjax.observe import history
from hetjax.observe import metrics


def test_a_long_run_keeps_a_window_and_exact_totals():
  rng = np.random.default_rng(0)
  h = history.History(series={"tau": [], "spread": []}, warmup=2, window=100)  # A rounds mode's.
  seen = []
  stream = metrics.RecordStream(h, global_batch=8, emulated=False, sinks=[seen.append])
  steps = 5000
  step_s = rng.uniform(0.1, 0.2, steps)
  compute = rng.uniform(0.0, 0.1, (steps, 2))
  wait = rng.uniform(0.0, 0.1, (steps, 2))
  for i in range(steps):
    h.record((4, 4), float(step_s[i]), 1.0, {"loss": 1.0}, compute_s=compute[i], tau=[i, i])
    # The step before's wait and spread arrive a step late (none before step 0: ignored).
    h.arrived(i - 1, wait_s=wait[i - 1], spread=[float(i - 1)] * 2)
    h.lr[i] = 0.5
    if i == 10:
      h.evals[i] = {"accuracy": 0.25}  # Long before the window: the latest still kept.
    stream.pop()
    assert len(h.shares) < 200 and len(h.lr) < 200  # The history keeps its own bound.
  assert list(h.awaiting) == [steps - 1]
  h.arrived(steps - 1, wait_s=wait[-1], spread=[float(steps - 1)] * 2)
  h.arrived(steps - 1, wait_s=wait[0], spread=[0.0] * 2)  # Already there: ignored.
  stream.pop()
  # The series are trimmed with the window, entry for entry.
  hosts = h.per_host(2, warmup=2)
  assert hosts[0]["tau"] == list(range(h.dropped, steps)) == [s[0] for s in h.series["tau"]]
  assert hosts[1]["spread"] == [float(i) for i in range(h.dropped, steps)]
  assert h.samples_per_sec(warmup=2) == pytest.approx(8 * (steps - 2) / step_s[2:].sum())
  idle = wait[2:].sum(0) / (compute[2:].sum(0) + wait[2:].sum(0))
  np.testing.assert_allclose([hosts[0]["idle_fraction"], hosts[1]["idle_fraction"]], idle)
  assert [r["step"] for r in seen] == list(range(1, steps + 1)) and all(r["lr"] == 0.5 for r in seen)
  assert [r["step"] for r in seen if "eval" in r] == [11] and h.evals == {10: {"accuracy": 0.25}}
  assert seen[-1]["time_s"] == pytest.approx(step_s.sum())
  n, total_s, busy_compute, busy_wait = h.steady_totals(warmup=2, hosts=2)
  assert (h.steps, n) == (steps, steps - 2)
  assert total_s == pytest.approx(step_s[2:].sum())
  np.testing.assert_allclose(busy_compute, compute[2:].sum(0))
  np.testing.assert_allclose(busy_wait, wait[2:].sum(0))


def test_a_trainer_with_a_small_window_writes_every_record_and_summarises_the_whole_run(
    tmp_path, monkeypatch):
  monkeypatch.setattr(history, "WINDOW", 4)
  hetjax.initialize()
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(8,))
  tr = trainer.Trainer(task, optax.sgd(0.1), data.load("digits"),
                       trainer.TrainConfig(global_batch=16, microbatch=8))
  summary = tr.fit(20, out=str(tmp_path))
  records = metrics.read_records(str(tmp_path))
  assert [r["step"] for r in records] == list(range(1, 21)) and len(tr.history.shares) <= 8
  assert tr.step == 20 and summary["steps"] == 20
  steady = records[2:]
  assert summary["samples_per_sec"] == pytest.approx(16 * 18 / sum(r["step_s"] for r in steady))
  wait = sum(r["wait_s"][0] for r in steady)
  busy = wait + sum(r["compute_s"][0] for r in steady)
  assert summary["per_host"][0]["idle_fraction"] == pytest.approx(wait / busy)
  assert records[-1]["time_s"] == pytest.approx(sum(r["step_s"] for r in records))
