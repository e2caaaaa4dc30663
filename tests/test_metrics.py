"""metrics.jsonl, TensorBoard event files, the record stream and the progress line."""

import glob
import io
import json
import os

import numpy as np
import pytest

import _metrics_fixture as fixture
from hetjax.observe import metrics
from hetjax.observe import progress
from hetjax.trainer import History


def _event_file(out):
  files = glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
  assert len(files) == 1, files
  return files[0]


def test_every_step_is_on_disk_before_close_and_reads_back(tmp_path):
  records = fixture.records()
  writer = metrics.MetricsWriter(str(tmp_path))
  for r in records[:5]:
    writer.write(r)
  # A run that crashes now keeps its five steps.
  assert [r["step"] for r in metrics.read_records(str(tmp_path))] == [1, 2, 3, 4, 5]
  for r in records[5:]:
    writer.write(r)
  writer.close()
  assert metrics.read_records(str(tmp_path)) == records


def _scalars(out):
  """TensorBoard's own reader over OUT/tensorboard: {tag: [(step, value)]}."""
  from tensorboard.backend.event_processing import event_accumulator as accumulator
  ea = accumulator.EventAccumulator(os.path.join(out, "tensorboard"))
  ea.Reload()
  return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path):
  records = fixture.records(steps=4)
  with metrics.MetricsWriter(str(tmp_path)) as writer:
    for r in records:
      writer.write(r)
  _event_file(str(tmp_path))
  scalars = _scalars(str(tmp_path))
  assert [step for step, _ in scalars["host2/share"]] == [1, 2, 3, 4]
  want = {"loss": records[-1]["loss"], "samples_per_sec": records[-1]["samples_per_sec"],
          "metrics/accuracy": records[-1]["metrics"]["accuracy"], "host1/share": 16.0,
          "host2/compute_s": records[-1]["compute_s"][2], "host0/wait_s": records[-1]["wait_s"][0]}
  for tag, value in want.items():
    assert scalars[tag][-1] == (4, pytest.approx(np.float32(value))), tag


def test_every_step_reaches_the_event_file_before_close(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path))
  for r in fixture.records(steps=3):
    writer.write(r)
  try:
    assert [step for step, _ in _scalars(str(tmp_path))["loss"]] == [1, 2, 3]
  finally:
    writer.close()


def test_without_tensorboard_only_the_jsonl_is_written(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as writer:
    writer.write(fixture.records(steps=1)[0])
  assert os.listdir(tmp_path) == ["metrics.jsonl"]


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("wait_s"), r"missing key\(s\) \['wait_s'\]"),
    (lambda r: r.update(epoch=1), r"unknown key\(s\) \['epoch'\]"),
    (lambda r: r.update(step=1.5), "'step' must be an int"),
    (lambda r: r.update(emulated="yes"), "'emulated' must be a bool"),
    (lambda r: r.update(compute_s=[0.1, 0.2]), "one entry per host"),
    (lambda r: r.update(wait_s=0.1), "'wait_s' must be a list with one number per host"),
    (lambda r: r.update(shares=[16, 16, 15]), "sum to 47, not the global batch 48"),
    (lambda r: r.update(metrics={"accuracy": "high"}), "dict of name -> number"),
])
def test_schema_drift_fails_loudly(tmp_path, change, message):
  record = fixture.records(steps=1)[0]
  change(record)
  with metrics.MetricsWriter(str(tmp_path)) as writer:
    with pytest.raises(ValueError, match=message):
      writer.write(record)


def test_numpy_values_are_written_as_plain_json(tmp_path):
  record = fixture.records(steps=1)[0]
  record.update(loss=np.float32(0.5), step=np.int64(0), shares=list(np.array([16, 16, 16])),
                emulated=np.bool_(True))
  with metrics.MetricsWriter(str(tmp_path)) as writer:
    writer.write(record)
  line = json.loads(open(tmp_path / "metrics.jsonl").read())
  assert line["loss"] == 0.5 and line["shares"] == [16, 16, 16] and line["emulated"] is True


def test_a_torn_last_line_is_dropped_but_a_bad_middle_line_is_named(tmp_path):
  records = fixture.records(steps=3)
  lines = [json.dumps(r) for r in records]
  path = tmp_path / "metrics.jsonl"
  path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])  # Died while writing step 2.
  assert [r["step"] for r in metrics.read_records(str(path))] == [1, 2]
  path.write_text(lines[0] + "\n" + lines[1][:40] + "\n" + lines[2] + "\n")
  with pytest.raises(ValueError, match="line 2 is not JSON"):
    metrics.read_records(str(path))


def _step(history, shares, compute, previous_wait, step_s, loss):
  """What Trainer.train_step appends: the wait of the step before arrives now."""
  history.shares.append(tuple(shares))
  history.compute_s.append(compute)
  if previous_wait is not None:
    history.wait_s.append(previous_wait)
  history.step_s.append(step_s)
  history.loss.append(loss)
  history.metrics.append({"loss": loss, "accuracy": 0.5})


def test_the_record_stream_emits_each_step_once_its_wait_is_known():
  history, seen = History(), []
  stream = metrics.RecordStream(history, global_batch=48, emulated=False, first_step=100,
                                sinks=[seen.append])
  _step(history, (24, 24), [0.1, 0.2], None, 0.5, 2.0)
  assert stream.pop() == []
  _step(history, (30, 18), [0.15, 0.15], [0.1, 0.0], 0.25, 1.5)
  (first,) = stream.pop()
  assert first == {"step": 101, "time_s": 0.5, "loss": 2.0, "metrics": {"accuracy": 0.5},
                   "samples_per_sec": 96.0, "step_s": 0.5, "global_batch": 48, "shares": [24, 24],
                   "compute_s": [0.1, 0.2], "wait_s": [0.1, 0.0], "emulated": False}
  history.wait_s.append([0.01, 0.02])  # Trainer.summary() gathers the last waits.
  (last,) = stream.pop()
  assert (last["step"], last["time_s"], last["samples_per_sec"], last["wait_s"]) == (
      102, 0.75, 192.0, [0.01, 0.02])
  assert stream.pop() == [] and seen == [first, last]
  # A second `fit` makes a new stream: it continues, it does not repeat.
  later = metrics.RecordStream(history, global_batch=48, emulated=False, first_step=100)
  _step(history, (24, 24), [0.1, 0.1], None, 0.25, 1.0)
  history.wait_s.append([0.0, 0.0])
  assert [(r["step"], r["time_s"]) for r in later.pop()] == [(103, 1.0)]


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_progress_in_a_log_prints_every_n_steps_and_the_last():
  out = io.StringIO()
  bar = progress.Progress(25, host_id=0, stream=out, every=10)
  for r in fixture.records(steps=25):
    bar.update(r)
  bar.close()
  lines = out.getvalue().splitlines()
  assert [line.split()[1] for line in lines] == ["10/25", "20/25", "25/25"]
  assert "shares 28/14/6" in lines[-1] and "samples/s" in lines[-1] and "(emulated speeds)" in lines[-1]
  assert lines[-1].split("ETA ")[1].startswith("0:00")


def test_progress_on_a_terminal_rewrites_one_line():
  out, clock = io.StringIO(), _Clock()
  bar = progress.Progress(30, host_id=0, stream=out, tty=True, clock=clock, min_interval_s=1.0)
  for r in fixture.records(steps=30):
    clock.now += 0.4  # Redraws at most once a second.
    bar.update(r)
  bar.close()
  text = out.getvalue()
  assert "\n" not in text[:-1] and text.endswith("\n")
  assert 10 <= text.count("\r") <= 13
  assert text.rstrip().split("\r")[-1].startswith("step 30/30")


def test_progress_on_other_hosts_prints_nothing():
  out = io.StringIO()
  bar = progress.Progress(5, host_id=1, stream=out, every=1, tty=False)
  for r in fixture.records(steps=5):
    bar.update(r)
  bar.close()
  assert out.getvalue() == ""


def test_eta_is_steps_left_times_recent_step_time():
  bar = progress.Progress(110, host_id=0, stream=io.StringIO())
  record = dict(fixture.records(steps=1)[0], step=10, step_s=0.5)
  bar.update(record)
  assert bar.eta_s(record) == pytest.approx(100 * 0.5)
  assert progress.format_eta(3725) == "1:02:05" and progress.format_eta(65) == "1:05"
  assert progress.format_eta(float("inf")) == "?"


def test_eta_forgets_the_compilation_steps():
  bar = progress.Progress(100, host_id=0, stream=io.StringIO())
  base = fixture.records(steps=1)[0]
  for step, seconds in enumerate([30.0, 2.0, 0.1, 0.1]):
    bar.update(dict(base, step=step + 1, step_s=seconds))
  assert bar.eta_s(dict(base, step=4)) == pytest.approx(96 * 0.1)


def test_the_report_skips_the_same_warm_up_as_the_trainer():
  from hetjax import trainer
  from hetjax.observe import report
  assert report.WARMUP_STEPS == trainer.WARMUP_STEPS
