"""`hetjax report OUT` on a recorded run folder (3 hosts, 30 steps, known speeds)."""

import json

import numpy as np
import pytest

import _metrics_fixture as fixture
from hetjax.observe import metrics
from hetjax.observe import report


def _run_folder(path, records, summary=True):
  with metrics.MetricsWriter(str(path)) as writer:
    for r in records:
      writer.write(r)
  if summary:
    (path / "summary.json").write_text(json.dumps(
        {"steps": len(records), "balancer_mode": "dynamic", "emulated_speeds": True,
         "balancer_decisions": fixture.DECISIONS, "device_batches": [8, 4, 1],
         "step_peak_per_host": [{"bytes": 22_834_140, "unsharded": 53_789_960},
                                {"bytes": 53_789_960, "unsharded": 53_789_960},
                                {"bytes": None, "unsharded": None}]}))
  return path


def _expected(records):
  """The report's figures, recomputed here with numpy from the records."""
  steady = records[2:]
  shares = np.array([r["shares"] for r in steady], float)
  compute = np.array([r["compute_s"] for r in steady])
  wait = np.array([r["wait_s"] for r in steady])
  measured = fixture.GLOBAL_BATCH * len(steady) / np.sum([r["step_s"] for r in steady])
  busy = shares > 0  # A host with no samples in a step says nothing about its speed.
  own = (shares * busy).sum(0) / (compute * busy).sum(0)
  idle = wait.sum(0) / (wait.sum(0) + compute.sum(0))
  return measured, own, idle


def test_report_on_a_recorded_run(tmp_path, capsys):
  records = fixture.records()
  out = _run_folder(tmp_path / "run", records)
  assert report.main([str(out)]) == 0
  printed = capsys.readouterr().out

  png = (out / "report.png").read_bytes()
  assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
  text = (out / "report.txt").read_text()
  assert printed.startswith(text)

  measured, own, idle = _expected(records)
  # By construction each host's own speed is speeds[i] / per-sample seconds.
  np.testing.assert_allclose(own, np.array(fixture.SPEEDS) / fixture.PER_SAMPLE_S, rtol=1e-9)
  fig = report.analyze(*report.load_run(str(out)))
  assert fig.measured_samples_per_sec == pytest.approx(measured, rel=1e-9)
  assert fig.ideal_samples_per_sec == pytest.approx(own.sum(), rel=1e-9)
  assert fig.efficiency == pytest.approx(measured / own.sum(), rel=1e-9)
  np.testing.assert_allclose(fig.idle_fraction, idle, rtol=1e-9)
  assert (fig.balancer_moves, fig.balancer_decisions, fig.split_changes) == (3, 6, 3)
  assert fig.emulated and fig.warmup_steps == 2 and fig.steps == 30

  assert "(emulated speeds)" in text
  assert f"efficiency {measured / own.sum():.1%}" in text
  assert f"{measured:,.1f} samples/s measured, {own.sum():,.1f} ideal" in text
  for i in range(3):
    assert f"{own[i]:13,.1f}  {records[-1]['shares'][i]:10d}  {idle[i]:.1%}" in text
  assert "dynamic, 3 moves after warm-up (6 decisions); the split changed 3 times" in text
  assert "device batches (blocks per device per program): 8/4/1" in text
  assert ("step peak per device, MB (XLA's memory analysis; without sharding within the host): "
          "host 0 22.8 (53.8), host 1 53.8 (53.8), host 2 ? (?)") in text


def test_a_crashed_run_without_summary_still_reports(tmp_path, capsys):
  out = _run_folder(tmp_path / "run", fixture.records(steps=12), summary=False)
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"step": 12, "time_s"')  # Died mid-line.
  assert report.main([str(out)]) == 0
  text = capsys.readouterr().out
  assert "12 steps" in text and "balancer: unknown (summary.json missing" in text
  assert "device batches" not in text and "step peak" not in text
  assert (out / "report.png").stat().st_size > 0


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "does not exist; run `hetjax train ... --out"),
    (lambda p: p.mkdir(), "has no metrics.jsonl; run `hetjax train ... --out"),
    (lambda p: (p.mkdir(), (p / "metrics.jsonl").write_text("")), "holds no step records"),
])
def test_a_folder_without_metrics_says_what_to_run(tmp_path, capsys, setup, message):
  folder = tmp_path / "run"
  setup(folder)
  assert report.main([str(folder)]) == 2
  assert message in capsys.readouterr().err


def test_an_api_run_with_fit_out_writes_what_the_cli_writes_and_its_report_has_the_eval_panel(tmp_path):
  import hetjax
  from hetjax import models as zoo
  from hetjax import optimizers, trainer
  from hetjax.input import data

  hetjax.initialize()
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))
  opt = optimizers.make("adam", 1e-2, schedule="cosine", warmup_steps=2, total_steps=6, clip_norm=1.0)
  tr = trainer.Trainer(task, opt, data.load("digits"), trainer.TrainConfig(global_batch=32, microbatch=8))
  out = tmp_path / "api"
  summary = tr.fit(6, out=str(out), eval_every=2, eval_source=data.load("digits", "test"))
  assert json.loads((out / "summary.json").read_text())["steps"] == 6
  records = metrics.read_records(str(out))
  assert [r["step"] for r in records] == list(range(1, 7))
  # lr of each update: warm-up 0 -> 1e-2 over 2 updates, then cosine to 0 at update 6.
  lr = [r["lr"] for r in records]
  np.testing.assert_allclose(lr, [0.0, 5e-3, 1e-2, 1e-2 * 0.5 * (1 + np.cos(np.pi / 4)),
                                  5e-3, 1e-2 * 0.5 * (1 + np.cos(3 * np.pi / 4))], rtol=1e-5, atol=1e-9)
  assert [r["step"] for r in records if "eval" in r] == [2, 4, 6]
  assert summary["eval"]["step"] == 6 and summary["eval"] == {"step": 6, **records[-1]["eval"]}
  from tensorboard.backend.event_processing import event_accumulator  # TensorBoard's own reader.
  events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
  events.Reload()
  tags = set(events.Tags()["scalars"])
  assert {"lr", "eval/accuracy", "eval/loss"} <= tags
  fig, text = report.make_report(str(out))
  assert fig.evaluations == 3 and fig.last_eval_step == 6
  assert f"evaluation: accuracy {records[-1]['eval']['accuracy']:.4f}, loss " in text
  assert "after step 6 (3 evaluations during training)" in text
  assert (out / "report.png").stat().st_size > 10_000


def _rounds_records(rounds=12, b=16):
  """A hybrid run: taus 1,1,1 for 2 warm-up rounds, then 4,2,1; known spreads and reduction seconds."""
  out, t = [], 0.0
  for r in range(rounds):
    taus = [1, 1, 1] if r < 2 else [4, 2, 1]
    shares = [tau * b for tau in taus]
    compute = [0.01 * tau for tau in taus]
    reduction = 0.004 + 0.001 * (r % 2)
    round_s = max(compute) + reduction
    t += round_s
    metrics = {"accuracy": 0.5, "reduction_s": reduction}
    metrics.update({f"tau/{i}": float(tau) for i, tau in enumerate(taus)})
    metrics.update({f"spread/{i}": 0.1 * (i + 1) / (r + 1) for i in range(3)})
    out.append({"step": r + 1, "time_s": t, "loss": 1.0, "metrics": metrics,
                "samples_per_sec": sum(shares) / round_s, "step_s": round_s,
                "global_batch": sum(shares), "shares": shares, "compute_s": compute,
                "wait_s": [max(compute) - c + reduction for c in compute], "emulated": True})
  return out


def test_a_rounds_run_is_reported_in_rounds_with_taus_reduction_and_spread(tmp_path, capsys):
  records = _rounds_records()
  out = tmp_path / "run"
  with metrics.MetricsWriter(str(out)) as writer:
    for r in records:
      writer.write(r)
  (out / "summary.json").write_text(json.dumps(
      {"mode": "hybrid", "balancer_mode": "hybrid rounds, taus from speeds", "emulated_speeds": True}))
  assert report.main([str(out)]) == 0
  text = capsys.readouterr().out
  fig = report.analyze(*report.load_run(str(out)))
  r = fig.rounds
  steady = records[2:]
  assert r.mode == "hybrid" and r.last_taus == [4, 2, 1] and r.mean_taus == [4.0, 2.0, 1.0]
  assert r.samples_per_round == [64.0, 32.0, 16.0]
  assert r.round_s == pytest.approx(np.mean([x["step_s"] for x in steady]), rel=1e-12)
  assert r.reduction_s == pytest.approx(0.0045, rel=1e-12)
  np.testing.assert_allclose(r.last_spread, [0.1 / 12, 0.2 / 12, 0.3 / 12])
  np.testing.assert_allclose(r.mean_spread, [0.1 * (i + 1) * np.mean([1 / (k + 1) for k in range(2, 12)])
                                             for i in range(3)])
  assert "hybrid mode: 12 rounds (2 warm-up rounds left out), 3 hosts" in text
  assert f"of which the reduction 4.5 ms ({0.0045 / r.round_s:.1%})" in text
  assert "taus: hybrid rounds, taus from speeds" in text
  assert "steps" not in text and "share" not in text
  assert (out / "report.png").stat().st_size > 10_000
  # The same figures reach TensorBoard and the progress line.
  assert metrics.scalars_of(records[-1])["metrics/spread/2"] == pytest.approx(0.3 / 12)
  from hetjax.observe import progress
  line = progress.format_line(records[-1], 12, 1.0)
  assert line.startswith("round 12/12  loss 1.0000")
  assert f"taus 4/2/1  samples 64/32/16  spread max {0.3 / 12:.3g}  reduction 5 ms" in line


def test_a_sync_run_has_no_rounds_figures():
  assert report.analyze(None, fixture.records()).rounds is None


def test_panel_a_bins_compute_and_wait_as_fractions_of_the_step_time():
  records = fixture.records(steps=30)
  starts, ends, compute, wait = report.binned_fractions(records, 3, bins=10)
  assert len(starts) == 10 and starts[0] == 0 and ends[-1] == 30  # Bins of 3 steps, over [0, 30].
  group = records[3:6]
  total = sum(r["step_s"] for r in group)
  for i in range(3):
    assert compute[i][1] == pytest.approx(sum(r["compute_s"][i] for r in group) / total)
    assert wait[i][1] == pytest.approx(sum(r["wait_s"][i] for r in group) / total)
    assert 0 < compute[i][1] + wait[i][1] <= 1  # The rest of a step is neither (input, dispatch).


def test_a_resume_is_found_and_said_and_the_reduction_share_printed(tmp_path):
  records = fixture.records(steps=20)
  for r in records[12:]:  # The restarted process's clock starts again after step 12.
    r["time_s"] -= records[12]["time_s"] - records[12]["step_s"]
  fig = report.analyze(None, records)
  assert fig.resumes == [12]
  assert report.resumed_at(fixture.records(steps=20)) == []  # One process: no mark.
  steady = records[2:]
  reduction = np.mean([min(r["wait_s"]) for r in steady])
  assert fig.reduction_s == pytest.approx(reduction, rel=1e-9)
  text = report.format_text(fig, "run")
  assert "resumed after step 12" in text
  assert f"of which the reduction {reduction * 1e3:,.1f} ms ({reduction / fig.step_s:.1%}" in text
  report.plot(records, fig, str(tmp_path / "r.png"))  # Draws with the marker.
