"""The arithmetic of where a job's time went, on hand-made phase records (no JAX, no processes)."""

import json

import pytest

from hetjax import phases
from hetjax.observe import goodput as g
from hetjax.observe import goodput_peaks, goodput_record, goodput_saving, goodput_summary


def _attempt(n, start, at=None, restart_count=None):
  return {"kind": "attempt", "attempt": n, "process_start": start, "at": at or start, "pid": n,
          "restart_count": n if restart_count is None else restart_count}


def _phase(name, start, end, step=None, failed=False):
  """A phase's start and end lines (nest by listing an inner phase between them)."""
  return ({"kind": "start", "phase": name, "at": start, "step": step},
          {"kind": "end", "phase": name, "at": end, "step": step, "failed": failed})


def _step(step, at, step_s, compute_s, wait_s, reduction_s=0.0, flops=None):
  return {"kind": "step", "step": step, "at": at, "step_s": step_s, "compute_s": compute_s,
          "wait_s": wait_s, "reduction_s": reduction_s, "flops": flops}


def _one_attempt_lines():
  """Process at 0; startup to 2; joining 2-3; building 3-10 with restoring 8-9; training
  10-30 with a checkpoint 20-22 holding an agreement 20-21; 1 s untracked; summary 31-32."""
  b0, b1 = _phase("building", 3, 10)
  r0, r1 = _phase("restoring", 8, 9)
  t0, t1 = _phase("training", 10, 30, step=0)
  c0, c1 = _phase("checkpoint", 20, 22, step=4)
  a0, a1 = _phase("agreement", 20, 21, step=4)
  steps = [_step(1, 14, 4.0, 0.5, 0.5, 0.2, flops=100.0),   # compiling: 4 - 2 (typical) = 2 s
           _step(2, 15, 2.0, 1.0, 0.5, 0.2, flops=100.0)]
  steps += [_step(k, 15 + k, 2.0, 1.0, 0.5, 0.2, flops=100.0) for k in range(3, 9)]
  return [_attempt(0, 0.0), *_phase("joining", 2, 3), b0, r0, r1, b1, t0, *steps[:4], c0, a0, a1,
          c1, *steps[4:], t1, *_phase("summary", 31, 32), {"kind": "close", "at": 32}]


def test_nested_phases_count_once_each_and_every_second_has_one_cause():
  host = g.host_time(g.attempts_of(_one_attempt_lines()))
  s = host.seconds
  assert host.wall_s == 32 and sum(s.values()) == pytest.approx(32)
  assert (s["startup"], s["joining"], s["building"], s["restoring"]) == (2, 1, 6, 1)
  assert (s["checkpoint"], s["agreement"], s["summary"], s["untracked"]) == (1, 1, 1, 1)
  # Training: 20 s less the 2 s checkpoint = 18 s; 8 steps of 2 s (the first 4 s: 2 compiling).
  assert s["compiling"] == pytest.approx(2)
  assert s["step loop overhead"] == pytest.approx(18 - 18)  # 4 + 7 x 2 = 18 s of steps.
  assert s["compute"] == pytest.approx(0.5 * 0.5 + 7 * 1.0)  # The first step's half kept.
  assert s["reduction"] == pytest.approx(0.5 * 0.2 + 7 * 0.2)
  assert s["waiting for other hosts"] == pytest.approx(0.5 * 0.3 + 7 * 0.3)
  assert s["dispatch"] == pytest.approx(0.5 * 3.0 + 7 * 0.5) and s["waiting for input"] == 0
  assert host.goodput == pytest.approx(7.25 / 32)
  assert host.flops_per_s == pytest.approx(100 / 1.0)  # After warm-up: 6 steps, 600 / 6 s.


def test_steps_overlapping_their_phase_are_scaled_to_fit_it():
  t0, t1 = _phase("training", 0, 10, step=0)
  lines = [_attempt(0, 0.0), t0, *[_step(k, k, 3.0, 2.0, 1.0) for k in range(1, 5)], t1]
  s = g.host_time(g.attempts_of(lines), warmup=0).seconds
  assert s["compute"] == pytest.approx(4 * 2.0 * 10 / 12) and s["step loop overhead"] == 0
  assert sum(s.values()) == pytest.approx(10)


def _killed_and_restarted_lines():
  """Attempt 0: steps 1-15 (1 s each) from t=10, killed inside training at 26 (its last
  line, step 15 at 25, then one more second). Attempt 1 starts at 30, resumes at step 10."""
  first = [_attempt(0, 0.0), {"kind": "start", "phase": "training", "at": 10.0, "step": 0}]
  first += [_step(k, 10.0 + k, 1.0, 0.8, 0.1) for k in range(1, 16)]
  first += [{"kind": "start", "phase": "checkpoint", "at": 26.0, "step": 15}]  # Never ended.
  t0, t1 = _phase("training", 32, 42, step=10)
  second = [_attempt(1, 30.0), t0, *[_step(k, 22.0 + k, 1.0, 0.8, 0.1) for k in range(11, 21)],
            t1, {"kind": "close", "at": 42.0}]
  return first + second


def test_steps_redone_after_a_restart_are_progress_lost_with_their_first_time():
  attempts = g.attempts_of(_killed_and_restarted_lines())
  assert [a.start_step for a in attempts] == [0, 10]
  assert attempts[0].intervals[0].open and not attempts[0].closed
  host = g.host_time(attempts, warmup=0)
  s = host.seconds
  assert host.redone_steps == 5 and host.steps_run == 25 and host.attempts == 2
  assert s["progress lost"] == pytest.approx(5 * 1.0)
  assert s["restart wait"] == pytest.approx(30 - 26) and s["startup"] == pytest.approx(10 + 2)
  # The open training phase ends at the attempt's last line (26): 1 s after the last step
  # (at 25) is the fault's tail; the open checkpoint at 26 takes nothing.
  assert s["disruption"] == pytest.approx(1.0)
  assert host.wall_s == 42 and sum(s.values()) == pytest.approx(42)


def test_a_run_started_again_by_hand_from_step_0_is_a_new_job_and_a_resumed_one_is_not():
  lines = _killed_and_restarted_lines()
  lines[lines.index(next(l for l in lines if l.get("attempt") == 1))]["restart_count"] = 0
  assert g.host_time(g.attempts_of(lines), warmup=0).attempts == 2  # It resumed at step 10.
  t0, t1 = _phase("training", 50, 52, step=0)
  again = [_attempt(2, 45.0, restart_count=0), t0, _step(1, 51, 1.0, 0.5, 0.1), t1]
  host = g.host_time(g.attempts_of(lines + again), warmup=0)
  assert host.attempts == 1 and host.wall_s == 52 - 45


def test_the_job_is_the_hosts_mean_and_its_badput_is_listed_largest_first():
  a = g.host_time(g.attempts_of(_one_attempt_lines()), host=0)
  b = g.host_time(g.attempts_of(_killed_and_restarted_lines()), host=1, warmup=0)
  job = g.job_time([a, b])
  assert job.wall_s == pytest.approx(37) and sum(job.seconds.values()) == pytest.approx(37)
  assert job.goodput == pytest.approx((a.seconds["compute"] + b.seconds["compute"]) / 74)
  assert list(job.badput.values()) == sorted(job.badput.values(), reverse=True)
  assert job.recorded_s == pytest.approx(37 - 0.5)


def test_an_equal_split_prices_each_host_at_half_the_batch_and_saves_nothing_when_it_ran():
  # Host 0: 1 ms/sample; host 1: 3 ms/sample. Balanced 24/8: both 24 ms; equal 16/16: 48 ms.
  shares, compute, wait = [[24, 8]] * 4, [[0.024, 0.024]] * 4, [[0.002, 0.003]] * 4
  saving = goodput_saving.equal_split(shares, compute, wait, [0.030] * 4, 32, steps=100)
  assert saving.equal_step_s == pytest.approx(0.048 + 0.002)
  assert saving.balanced_step_s == pytest.approx(0.024 + 0.002)
  assert saving.saved_s == pytest.approx(100 * 0.024) and saving.fraction == pytest.approx(0.48)
  equal = goodput_saving.equal_split([[16, 16]] * 4, [[0.016, 0.048]] * 4, wait, [0.05] * 4, 32)
  assert equal.saved_s == pytest.approx(0.0, abs=1e-12)
  assert goodput_saving.equal_split([[32, 0]], [[0.03, 0.0]], [[0.0, 0.0]], [0.03], 32) is None


def test_vendor_peaks_are_labelled_and_a_cpu_has_none():
  assert goodput_peaks.peak("NVIDIA H100 80GB HBM3", "bf16").flops_per_s == pytest.approx(989.4e12)
  assert goodput_peaks.peak("NVIDIA H100 PCIe", "fp32").device == "H100 PCIe"
  assert goodput_peaks.peak("NVIDIA A100-SXM4-40GB", "fp32").flops_per_s == pytest.approx(19.5e12)
  assert goodput_peaks.peak("cpu") is None and goodput_peaks.peak(None) is None


def test_the_summary_entry_carries_each_hosts_flops_against_its_peak_and_says_emulated():
  host = g.host_time(g.attempts_of(_one_attempt_lines()))
  host.device_kind, host.devices, host.precision, host.emulated = "NVIDIA A100-SXM4-80GB", 2, "bf16", True
  entry = goodput_summary.fields([goodput_summary.host_vector(host)])
  h = entry["per_host"][0]
  assert h["peak_flops_per_s"] == pytest.approx(2 * 312e12) and h["peak_device"] == "A100"
  assert h["peak_fraction"] == pytest.approx(100 / 624e12) and "vendor figure" in h["peak_source"]
  text = "\n".join(goodput_summary.lines(entry, None, causes=None))
  assert "(emulated speeds)" in text and "achieved (emulated)" in text and "A100 peak" in text
  cpu = g.host_time(g.attempts_of(_one_attempt_lines()))
  assert "peak unknown" in goodput_summary.host_flops(
      goodput_summary.fields([goodput_summary.host_vector(cpu)])["per_host"][0])


def test_the_recorder_appends_a_restarted_process_and_starts_afresh_after_a_closed_job(
    tmp_path, monkeypatch):
  clock = iter(range(100, 1000)).__next__
  bus = phases.Phases(clock=clock)
  rec = goodput_record.Recorder(str(tmp_path), process_start=1.0, clock=clock)
  with bus.subscribe(rec):
    with bus.within(phases.JOINING):
      pass
    rec.bind(0)  # Lines before the host was known are written now.
    with bus.within(phases.TRAINING, 0):
      rec.step_sink(0, lambda share: 10.0 * share)(
          {"step": 1, "step_s": 0.5, "compute_s": [0.3, 0.2], "wait_s": [0.1, 0.2],
           "shares": [3, 1]})
  lines = g.read_lines(rec.path)  # No close line yet (a killed process never writes one).
  assert [l["kind"] for l in lines] == ["attempt", "start", "end", "start", "step", "end"]
  assert lines[4]["flops"] == 30.0 and lines[4]["reduction_s"] == 0.1
  rec.close()
  again = goodput_record.Recorder(str(tmp_path), process_start=1.0, clock=clock)
  again.bind(0)  # Another fit() of the same process: the same attempt goes on.
  assert again.attempt == 0 and len(g.read_lines(rec.path)) == 8
  again.close()
  monkeypatch.setattr(goodput_record.os, "getpid", lambda: -1)  # Another process: a restart.
  monkeypatch.setenv("HETJAX_RESTART_COUNT", "1")
  restarted = goodput_record.Recorder(str(tmp_path), process_start=200.0, clock=clock)
  restarted.close(0)
  assert [a.number for a in g.attempts_of(g.read_lines(rec.path))] == [0, 1]
  monkeypatch.setattr(goodput_record.os, "getpid", lambda: -2)
  monkeypatch.delenv("HETJAX_RESTART_COUNT")
  fresh = goodput_record.Recorder(str(tmp_path), process_start=300.0, clock=clock)
  fresh.close(0)  # After a closed job, without a restart count: a new job.
  with open(rec.path) as f:
    assert [json.loads(l)["attempt"] for l in f] == [0, 0]


def test_a_fit_that_fails_leaves_its_attempt_unclosed(tmp_path):
  bus_before = list(phases.PHASES._listeners)
  with pytest.raises(RuntimeError):
    with goodput_record.for_fit(str(tmp_path), 0):
      with phases.within(phases.TRAINING, 0):
        raise RuntimeError("a step failed")
  lines = g.read_lines(str(tmp_path / "phases" / "host0.jsonl"))
  assert [l["kind"] for l in lines] == ["attempt", "start", "end"] and lines[-1]["failed"]
  assert phases.PHASES._listeners == bus_before and goodput_record.active() is None


def test_waiting_for_input_is_its_own_cause_per_host_and_not_goodput():
  t0, t1 = _phase("training", 0, 10, step=0)
  starved = [{**_step(k, k, 2.0, 1.5, 0.5), "input_s": 1.0} for k in range(1, 6)]
  fed = [_step(k, k, 2.0, 1.5, 0.5) for k in range(1, 6)]  # An older record has no input_s.
  hosts = [g.host_time(g.attempts_of([_attempt(0, 0.0), t0, *steps, t1]), h, warmup=0)
           for h, steps in enumerate((starved, fed))]
  assert hosts[0].seconds["waiting for input"] == pytest.approx(5.0)
  assert hosts[0].seconds["compute"] == pytest.approx(2.5)
  assert hosts[1].seconds["waiting for input"] == 0 and hosts[1].seconds["compute"] == 7.5
  text = goodput_summary.lines(goodput_summary.from_job(g.job_time(hosts)), None)
  assert "host 0: goodput 25.0%" in text[2] and text[2].endswith("waiting for input 50.0%")
  assert "waiting for input" not in text[3]
