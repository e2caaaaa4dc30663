"""Heterogeneity emulation: pacing arithmetic and validation (no real sleeps)."""

from __future__ import annotations

import math

import pytest

from hetjax.config import Env
from hetjax.cluster import emulate


class FakeSleep:

  def __init__(self):
    self.calls: list[float] = []

  def __call__(self, seconds: float) -> None:
    self.calls.append(seconds)


@pytest.mark.parametrize("speed, compute_s, factor, emulated_s", [
    (1.0, 2.0, 1.0, 2.0),
    (0.5, 2.0, 1.0, 4.0),
    (0.25, 1.0, 1.0, 4.0),
    (0.25, 1.0, 2.0, 8.0),
    (1.0, 1.5, 3.0, 4.5),
    (0.5, 0.0, 1.0, 0.0),
])
def test_pace_stretches_compute_by_one_over_speed(speed, compute_s, factor, emulated_s):
  sleep = FakeSleep()
  assert emulate.Pacer(speed, sleep=sleep).pace(compute_s, factor) == pytest.approx(emulated_s)
  slept = sum(sleep.calls)
  assert slept == pytest.approx(emulated_s - compute_s)
  assert len(sleep.calls) == (1 if slept > 0 else 0)


def test_full_speed_never_sleeps():
  sleep = FakeSleep()
  pacer = emulate.Pacer(1.0, sleep=sleep)
  for compute_s in (0.0, 1e-9, 0.1, 3.0, 1e6):
    assert pacer.pace(compute_s) == compute_s
  assert not sleep.calls


@pytest.mark.parametrize("speed", [0.0, -0.5, 1.0001, 2.0, math.nan, math.inf])
def test_pacer_rejects_speed_outside_unit_interval(speed):
  with pytest.raises(ValueError, match=r"\(0, 1\]"):
    emulate.Pacer(speed)


@pytest.mark.parametrize("compute_s, factor, match", [
    (-1.0, 1.0, "compute_s"),
    (math.nan, 1.0, "compute_s"),
    (1.0, 0.5, "factor"),
    (1.0, 0.0, "factor"),
    (1.0, math.nan, "factor"),
])
def test_pace_rejects_bad_inputs(compute_s, factor, match):
  with pytest.raises(ValueError, match=match):
    emulate.Pacer(0.5, sleep=FakeSleep()).pace(compute_s, factor)


@pytest.mark.parametrize("env, speed", [
    ({}, 1.0),
    ({"HETJAX_SPEED": ""}, 1.0),
    ({"HETJAX_SPEED": "0.25"}, 0.25),
    ({"HETJAX_SPEED": "1"}, 1.0),
])
def test_speed_from_env(env, speed):
  assert emulate.speed_from_env(env) == speed


@pytest.mark.parametrize("raw, match", [
    ("fast", "not a number"),
    ("0", r"\(0, 1\]"),
    ("1.5", r"\(0, 1\]"),
    ("-1", r"\(0, 1\]"),
])
def test_speed_from_env_names_the_bad_value(raw, match):
  with pytest.raises(ValueError, match=match) as info:
    emulate.speed_from_env({"HETJAX_SPEED": raw})
  assert "HETJAX_SPEED" in str(info.value)


def test_check_speeds_accepts_a_valid_cluster():
  assert emulate.check_speeds([1, 0.5, 0.25], 3) == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("speeds, hosts, match", [
    ([1.0, 0.5], 3, "one speed per host"),
    ([1.0, 0.0], 2, r"host 1 must be in \(0, 1\]"),
    ([1.0, 1.5], 2, r"host 1 must be in \(0, 1\]"),
    ([0.5, 0.25], 2, "fastest host has speed 1.0"),
])
def test_check_speeds_errors(speeds, hosts, match):
  with pytest.raises(ValueError, match=match):
    emulate.check_speeds(speeds, hosts)


def test_parse_speeds():
  assert emulate.parse_speeds("1,0.5, 0.25") == [1.0, 0.5, 0.25]
  with pytest.raises(ValueError, match="'x' in '1,x' is not a number"):
    emulate.parse_speeds("1,x")


def test_slowdown_schedule_parses_and_applies_from_its_step():
  schedule = emulate.parse_slowdowns("2:3@50, 0:2@10")
  assert schedule == [emulate.Slowdown(2, 3.0, 50), emulate.Slowdown(0, 2.0, 10)]
  assert emulate.slowdown_factor(schedule, 2, 49) == 1.0
  assert emulate.slowdown_factor(schedule, 2, 50) == 3.0
  assert emulate.slowdown_factor(schedule, 1, 99) == 1.0


@pytest.mark.parametrize("text", ["2:3", "x:3@5", "1:0.5@3", "-1:2@3"])
def test_bad_slowdowns_are_refused(text):
  with pytest.raises(ValueError, match="slowdown"):
    emulate.parse_slowdowns(text)


def test_pacing_from_env_combines_speed_and_slowdown(monkeypatch):
  slept = []
  monkeypatch.setattr(emulate.time, "sleep", slept.append)
  assert emulate.pacing_from_env(0, {}) is None
  pace = emulate.pacing_from_env(1, {"HETJAX_SPEED": "0.5", "HETJAX_SLOWDOWN": "1:3@4"})
  assert pace(1.0, 3) == pytest.approx(2.0)
  assert pace(1.0, 4) == pytest.approx(6.0)
  assert slept == pytest.approx([1.0, 5.0])




def test_device_pacing_adds_time_proportional_to_samples_and_1_over_speed():
  sleep = FakeSleep()
  pacer = emulate.DevicePacer(0.25, 0.002, sleep=sleep)
  assert pacer.pace(0.01, samples=32) == pytest.approx(0.01 + 32 * 0.002 / 0.25)
  assert pacer.pace(0.01, samples=0) == pytest.approx(0.01)  # A host with no work waits for none.
  assert pacer.pace(0.0, samples=8, factor=3.0) == pytest.approx(8 * 0.002 * 3 / 0.25)
  assert sleep.calls == [pytest.approx(0.256), pytest.approx(0.192)]
  env = {"HETJAX_DEVICE_SAMPLE_MS": "0.01", "HETJAX_SPEED": "0.5", "HETJAX_SLOWDOWN": "1:3@10"}
  pace = emulate.pacing_from_env(1, env)
  assert pace(0.001, 9, 10) == pytest.approx(0.001 + 10 * 1e-5 / 0.5)
  assert pace(0.001, 10, 10) == pytest.approx(0.001 + 3 * 10 * 1e-5 / 0.5)
  assert emulate.pacing_from_env(0, {"HETJAX_DEVICE_SAMPLE_MS": "1"}) is not None
  with pytest.raises(ValueError, match="HETJAX_DEVICE_SAMPLE_MS='-1' must be a number of milliseconds > 0"):
    emulate.pacing_from_env(0, {"HETJAX_DEVICE_SAMPLE_MS": "-1"})


def test_the_trainer_knows_every_emulation_variable():
  """Every variable the emulation reads marks a run as emulated (`config.emulated_from_env`)."""
  import re
  read = set(re.findall(r"\bEnv\.([A-Z_]+)", open(emulate.__file__).read()))
  read.discard("FAULTS")  # Emulated faults change no speed: the run's figures stay real.
  assert {getattr(Env, name) for name in read} == set(Env.EMULATION)


def test_emulated_faults_name_a_host_a_kind_and_a_step():
  faults = emulate.parse_faults("1:stall-in-evaluation@4, 0:fail-write@6")
  assert faults == [emulate.Fault(1, "stall-in-evaluation", 4), emulate.Fault(0, "fail-write", 6)]
  stalled = []
  mine = emulate.Faults(1, faults, stall=lambda: stalled.append(True))
  mine.phase_started("evaluation", 2, 0.0)
  mine.phase_started("checkpoint", 4, 0.0)
  assert not stalled and mine.write_error(6) is None
  mine.phase_started("evaluation", 4, 0.0)
  assert stalled == [True]
  assert "No space left on device" in str(emulate.Faults(0, faults).write_error(6))
  with pytest.raises(ValueError, match="stall-in-PHASE"):
    emulate.parse_faults("1:stall-in-lunch@4")
  assert emulate.faults_from_env(2, {Env.FAULTS: "1:fail-write@6"}) is None


def test_host_env_entries_name_one_host_each_and_bad_ones_say_the_form():
  got = emulate.parse_host_env(["1:XLA_FLAGS=--xla_backend_optimization_level=0", "1:A=b=c",
                                "0:B="], hosts=2)
  assert got == {1: {"XLA_FLAGS": "--xla_backend_optimization_level=0", "A": "b=c"}, 0: {"B": ""}}
  with pytest.raises(ValueError, match="must be HOST:KEY=VALUE"):
    emulate.parse_host_env(["XLA_FLAGS=x"], hosts=2)
  with pytest.raises(ValueError, match="names host 2 but there are 2 hosts"):
    emulate.parse_host_env(["2:A=1"], hosts=2)
  with pytest.raises(ValueError, match="sets the HETJAX_\\* variables itself"):
    emulate.parse_host_env(["0:HETJAX_SPEED=0.5"], hosts=2)


def test_host_env_reaches_only_its_host():
  from hetjax.cluster import procs
  envs = procs.cluster_envs(2, 1, base={}, host_env={1: {"XLA_FLAGS": "--foo"}})
  assert "XLA_FLAGS" not in envs[0] and envs[1]["XLA_FLAGS"] == "--foo"
