"""The chaos soak's parts, in-process: emulated faults that fire once, the schedule, the lines it reads.

bench/chaos.py itself runs minutes of restarts (its table is in BUILD_NOTES);
what it decides and reads is tested here on the launcher's real words, and
the faults it injects end to end in test_watchdog, test_fault_tolerance and
test_modes_resume.
"""

import importlib.util
import pathlib
import sys

import pytest

from hetjax.cluster import emulate
from hetjax.config import Env

_SPEC = importlib.util.spec_from_file_location(
    "chaos_schedule", pathlib.Path(__file__).parents[1] / "bench" / "chaos_schedule.py")
cs = sys.modules.setdefault("chaos_schedule", importlib.util.module_from_spec(_SPEC))
_SPEC.loader.exec_module(cs)


def test_a_fault_fires_once_per_job_with_a_marker_folder(tmp_path):
  stalls = []
  env = {Env.FAULTS: "1:stall-in-step@5,1:stall-in-evaluation@4,1:fail-write@6",
         emulate.FAULTS_ONCE: str(tmp_path / "fired")}
  first = emulate.faults_from_env(1, env)
  first._stall = lambda: stalls.append("stalled")
  first.in_step(4)
  first.in_step(5)
  first.phase_started("evaluation", 6, 0.0)
  assert first.write_error(6).errno == 28 and first.write_error(6) is None
  assert stalls == ["stalled", "stalled"]
  again = emulate.faults_from_env(1, env)  # The restarted host: the same steps, no faults.
  again._stall = lambda: stalls.append("again")
  again.in_step(5)
  again.phase_started("evaluation", 6, 0.0)
  assert again.write_error(6) is None and stalls == ["stalled", "stalled"]
  # Without the folder a fault fires whenever its step comes (the tests' single attempts).
  plain = emulate.Faults(1, emulate.parse_faults("1:stall-in-step@5"), stall=lambda: stalls.append(7))
  plain.in_step(5)
  plain.in_step(6)
  assert stalls[-2:] == [7, 7]


def test_a_stall_in_a_step_rides_the_pacing_hook_without_changing_what_it_reports():
  assert emulate.with_step_faults(None, 0, {}) is None
  pace = lambda compute_s, step, samples=0: compute_s * 2
  assert emulate.with_step_faults(pace, 0, {Env.FAULTS: "0:fail-write@4"}) is pace
  hook = emulate.with_step_faults(None, 0, {Env.FAULTS: "0:stall-in-step@9"})
  assert hook(0.25, 3, 16) == 0.25  # Only stalls: the run is not marked emulated by it.
  with pytest.raises(ValueError, match="stall-in-step"):
    emulate.parse_faults("0:stall-in-lunch@4")


def test_the_schedule_covers_every_kind_names_host_0_and_extends_with_more_faults():
  for seed in range(5):
    schedule = cs.draw(12, seed)
    assert {f.kind for f in schedule} == set(cs.KINDS)
    assert schedule[0].step == 20
    for before, after in zip(schedule, schedule[1:]):  # A failed write surfaces steps later.
      assert after.step - before.step == (60 if before.kind == cs.FAIL_WRITE else 20)
    assert next(f for f in schedule if f.kind == cs.KILL).host == 0
    assert next(f for f in schedule if f.kind == cs.STOP).host == 0
    assert all(f.host is None for f in schedule if f.kind == cs.TERM_ALL)
    assert cs.draw(3, seed) == schedule[:3]
    inside = emulate.parse_faults(cs.faults_env(schedule))
    assert [(f.host, f.kind, f.step) for f in inside] == [
        (f.host, f.kind, f.step) for f in schedule if f.kind in cs.INSIDE]
  assert cs.draw(12, 0) != cs.draw(12, 1)
  with pytest.raises(ValueError, match="hosts >= 2"):
    cs.draw(3, 0, hosts=1)


def test_the_soak_reads_who_the_launcher_and_the_hosts_named():
  ended = cs.ENDED.search("[launcher] restart 1/5 after host 1 stopped making progress: the step "
                          "watchdog stopped the job (exit code 69; each live host's log holds ...)")
  assert ended.group(1) == "restart" and cs.blamed(ended.group(2)) == {1}
  assert cs.blamed("host 0 failed with signal SIGKILL") == {0}
  assert cs.blamed("hosts 1, 2 stopped responding: frozen; host 0 then ended with SIGABRT "
                   "because of it") == {1, 2}
  preempted = cs.ENDED.search("[launcher] preemption restart 2/5 after host 0 was preempted "
                              "(exit code 75)")
  assert preempted.group(1) == "preemption restart"
  assert cs.WRITE_FAILED.search("[launcher] host 1 could not write a checkpoint (exit code 74: "
                                "a full disk)").group(1) == "1"
  assert cs.REACHED.search("[host 1] hetjax train: preempted: checkpoint of step 62 saved in /c; "
                           "exiting with code 75 ... (The signal reached this host during step "
                           "60.)").group(1) == "1"
  assert cs.RESUMED.search("[host 0] hetjax: resumed from /tmp/s0/ckpt/30 (written by 2 host(s) "
                           "x [1, 1] device(s))").group(1) == "30"
  assert cs.STEP.search("[host 0] step  41/100  loss 2.2870").group(1) == "41"
  assert cs.EMULATED.search("[host 1] hetjax: emulated fault: host 1 stalls in step at step "
                            "45").group(2) == "1"
  fault = cs.Fault(cs.TERM_ALL, None, 40)
  assert fault.expected == {0, 1} and fault.env_item() is None and cs.ENDS[fault.kind] == "preemption"
