"""The run-wide watchdog: a job that stops moving ends on every host, naming the host to blame.

The decisions (who is behind, the limit of each phase, what the hosts'
lines say, the frozen host) are tested in-process on a recorded clock and a
fake key-value store; three `launch/local.py ... hetjax train` runs on 2
hosts, side by side, test them end to end: one host stuck inside its step
(emulated with a huge slowdown on the first attempt only), one stuck in
evaluation (an emulated fault), and one host frozen by SIGSTOP.
"""

import concurrent.futures
import re
import signal
import sys
import time

import pytest

import _cli_job
from hetjax import phases
from hetjax.config import Env
from hetjax.cluster import ending
from hetjax.cluster import procs
from hetjax.cluster import supervise
from hetjax.cluster import watchdog
from hetjax.cluster.watchdog import Position


# ---- the decisions ------------------------------------------------------------


def test_the_hosts_behind_the_furthest_one_are_named():
  at = {0: Position(3, 21, True), 1: Position(3, 20, False), 2: Position(3, 21, False)}
  assert watchdog.behind(at) == [1, 2]
  # Everyone in the same reduction: nobody is behind (a device or network hang).
  assert watchdog.behind({0: Position(3, 5, True), 1: Position(3, 5, True)}) == []
  # Evaluation: host 1 still reads its records while host 0 waits in the gather.
  at = {0: Position(9, 4, True, "evaluation"), 1: Position(9, 4, False, "evaluation")}
  assert watchdog.behind(at) == [1]
  # A phase boundary further on counts before the step: host 0 is in the save after step 4.
  assert watchdog.behind({0: Position(11, 4, True, "checkpoint"),
                          1: Position(9, 5, True, "training")}) == [1]
  # A host that never posted, or whose posts stopped, is named whatever its place.
  assert watchdog.behind({0: Position(3, 5, True), 1: None}) == [1]
  assert watchdog.behind({0: Position(3, 5, True), 1: Position(3, 5, True)}, frozen=[1]) == [1]
  assert Position.decode(at[1].encode()) == at[1]


def test_every_phase_has_a_limit_derived_from_the_one_knob():
  now = [0.0]
  dog = watchdog.Watchdog(clock=lambda: now[0], wall=lambda: 0.0)
  dog._reset(5.0, "round")
  dog.phase_started(phases.BUILDING, None, 0.0)
  assert dog.current_limit()[0] == watchdog.STARTUP_FACTOR * 5
  dog.phase_ended(phases.BUILDING, None, 0.0, False)
  assert dog.current_limit() is None  # Outside every phase: the user's own code.
  dog.phase_started(phases.TRAINING, 0, 0.0)
  dog.entered(0)
  assert dog.current_limit() == (watchdog.STARTUP_FACTOR * 5, "the first 3 rounds, 10 x --watchdog 5")
  dog.completed(0)
  for r in range(1, watchdog.WARMUP_STEPS):
    dog.entered(r)
    dog.completed(r)
  assert dog.current_limit() is None  # Between rounds, none outstanding.
  dog.entered(3)
  assert dog.current_limit() == (5.0, "a round, --watchdog 5")
  now[0] += 5.5
  assert dog.stalled_for() == (5.5, "5 s for a round, --watchdog 5")
  dog.completed(3)
  dog.phase_started(phases.EVALUATION, 4, 0.0)
  assert dog.current_limit()[0] == watchdog.PHASE_FACTOR * 5
  now[0] += 14.0
  dog.tick()  # A batch read: moving, however long the phase.
  now[0] += 14.0
  assert dog.stalled_for() is None
  dog._reset(0.0)
  dog.phase_started(phases.EVALUATION, 4, 0.0)
  assert dog.current_limit() is None  # 0: no stall checks.


def test_the_default_limit_follows_the_measured_steps():
  now = [0.0]
  dog = watchdog.Watchdog(clock=lambda: now[0])
  dog._reset(None)  # The default limit: max(20 x the median step, 5 minutes).
  dog.phase_started(phases.TRAINING, 0, 0.0)
  for step in range(watchdog.WARMUP_STEPS + 3):
    dog.entered(step)
    now[0] += 1000.0 if step == 0 else 2.0  # Compiling is slow, and never counts.
    dog.completed(step)
  assert dog.step_limit() == watchdog.MIN_DEFAULT_S
  for step in range(10, 10 + 2 * watchdog._RECENT):  # Slow steps raise the limit.
    dog.entered(step)
    now[0] += 60.0
    dog.completed(step)
  assert dog.step_limit() == watchdog.STEP_FACTOR * 60.0


class _Store:
  """JAX's key-value client, as the watchdog uses it."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.values[key] = value

  def key_value_try_get(self, key):
    return self.values[key]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_stopping_host_names_a_frozen_host_and_leaves_with_the_verdict(capfd):
  store, codes = _Store(), []
  dog = watchdog.Watchdog(exit=codes.append)
  dog._reset(0.5)
  dog._client = store
  dog.phase_started(phases.EVALUATION, 4, 0.0)
  with dog.waiting():
    mine = dog.position
    store.values["hetjax/watchdog/0"] = Position(1, 4, False, "evaluation",
                                                          time.time() - 612, 7).encode()
    ending.post(store, 1, watchdog.STALLED_EXIT, "6.0 s over 1.5 s for evaluation")
    dog.end(ending.verdicts(store), host_id=1, num_hosts=2, client=store, mine=mine,
            stalled=(6.0, "1.5 s for evaluation, 3 x --watchdog 0.5"))
  err = capfd.readouterr().err  # faulthandler writes to the file descriptor.
  assert codes == [watchdog.STALLED_EXIT]
  assert "hetjax: watchdog: host 1: no progress for 6.0 s" in err and "Current thread" in err
  assert "host 0: in evaluation at step 4 for" in err  # The first look: behind, in evaluation.
  assert "host 0: stopped posting (frozen, or its machine is unreachable)" in err  # The second.
  assert err.count(f"{watchdog.MARKER} 0\n") == 2
  assert "hetjax/ended/1" in store.values  # Acknowledged; the frozen host 0 is not waited for.


def test_one_hosts_failure_is_said_on_every_host_with_its_code(capsys):
  store, codes = _Store(), []
  dog = watchdog.Watchdog(exit=codes.append)
  ending.post(store, 1, 74, "host 1: cannot write checkpoint /ck/4: No space left on device.")
  ending.acknowledge(store, 0)
  ending.acknowledge(store, 1)  # Every other host has said it too: host 2 leaves at once.
  dog.end(ending.verdicts(store), host_id=2, num_hosts=3, client=store, mine=None)
  err = capsys.readouterr().err
  assert codes == [74]
  assert "hetjax: host 1: cannot write checkpoint /ck/4: No space left on device." in err
  assert f"{ending.MARKERS[74]} 1" in err


def _posts(store, **beats):
  for host, beat in beats.items():
    store.values[f"hetjax/watchdog/{host[1:]}"] = Position(1, 3, False, beat=beat).encode()


def test_host_0_names_a_host_whose_posts_stopped_before_the_coordination_service_does(capsys):
  store, peers = _Store(), watchdog._Peers(heartbeat_s=12)
  _posts(store, h0=1, h1=1)
  peers.check(store, now=0.0, skip=0)
  _posts(store, h0=5, h1=1)  # Host 1 froze.
  peers.check(store, now=3.0, skip=0)
  assert capsys.readouterr().err == ""  # Not yet a third of the heartbeat timeout.
  peers.check(store, now=5.0, skip=0)
  peers.check(store, now=6.0, skip=0)  # Named once.
  err = capsys.readouterr().err
  assert err.count("hetjax: host 1 stopped responding: frozen, or its machine is unreachable "
                   "(no sign of life for 5 s; the coordination service declares it dead after "
                   "HETJAX_HEARTBEAT_TIMEOUT=12 s") == 1


def test_the_launcher_reads_who_stopped_responding_from_the_hosts_lines():
  found = supervise.Findings()
  lines = ["E1201 coordination_service.cc:1549] ... UNAVAILABLE: The following tasks are "
           "unhealthy (stopped sending heartbeats):", "1", "/job:jax_worker/replica:0/task:2",
           "The tasks have crashed.", "3"]
  for line in lines:
    found.scan(0, line)
  found.scan(1, f"{watchdog.MARKER} 1,2")
  assert found.unresponsive == {1, 2} and found.stalled == {1, 2}
  outcome = procs.Outcome([-signal.SIGABRT, None, None], failed_host=0, unresponsive=[1, 2],
                          tails=[["abort"], ["before"], []])
  text = procs.describe(outcome)
  assert text.startswith("hosts 1, 2 stopped responding: frozen, or its machine is unreachable")
  assert "host 0 then ended with signal SIGABRT because of it" in text
  assert "output lines of host 1" in text


# ---- end to end -------------------------------------------------------------------


def _shell(command: list[str], first_attempt_env: str) -> list[str]:
  """`command` with `first_attempt_env` exported on the launcher's first attempt only."""
  quoted = " ".join(f"'{c}'" for c in command)
  return ["sh", "-c", f'if [ "$HETJAX_RESTART_COUNT" = 0 ]; then export {first_attempt_env}; '
                      f"fi; exec {quoted}"]


_LIMIT_S = 5  # --watchdog: evaluation gets 3 x, far above a healthy one however loaded the machine.


def _stuck_job(tmp_path) -> _cli_job.Job:
  """Host 1 stalls in the evaluation after step 4 on the first attempt (emulated); --max-restarts 1."""
  command = _cli_job.train_command(tmp_path / "run", "--ckpt-dir", str(tmp_path / "ckpt"),
                                   "--ckpt-every", "2", "--eval-every", "4",
                                   "--watchdog", str(_LIMIT_S))
  command[command.index("--steps") + 1] = "6"
  return _cli_job.Job(["--max-restarts", "1"],
                      _shell(command, f"{Env.FAULTS}=1:stall-in-evaluation@4"))


def _failing_write_job(tmp_path) -> _cli_job.Job:
  """Host 1's checkpoint of step 4 fails in orbax's background commit (emulated)."""
  command = _cli_job.train_command(tmp_path / "run", "--ckpt-dir", str(tmp_path / "ckpt"),
                                   "--ckpt-every", "2")
  return _cli_job.Job(["--max-restarts", "1"], command, env={Env.FAULTS: "1:fail-write@4"})


def _freeze_host_1(job: _cli_job.Job) -> int:
  job.wait_for_step(5)
  job.signal_hosts([1], signal.SIGSTOP)
  return job.finish()


@pytest.fixture(scope="module")
def ended_jobs(tmp_path_factory):
  """{"stuck": (exit code, output, folder), "write": (...), "frozen": (...)}: side by side.

  Each is mostly waiting (the stalled host's 15 s, the frozen host's 12 s of
  missed heartbeats): run one after the other, the suite would wait thrice.
  What each job prints depends on its own hosts only.
  """
  folders = {name: tmp_path_factory.mktemp(name) for name in ("stuck", "write", "frozen")}
  jobs = {"stuck": _stuck_job(folders["stuck"]), "write": _failing_write_job(folders["write"]),
          "frozen": _cli_job.Job(["--heartbeat-timeout", "12"],
                                 _cli_job.train_command(folders["frozen"] / "run", warm=False))}
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      freezing = pool.submit(_freeze_host_1, jobs["frozen"])
      codes = {"stuck": jobs["stuck"].finish(), "write": jobs["write"].finish(),
               "frozen": freezing.result()}
  finally:
    for job in jobs.values():
      job.kill()
  return {name: (codes[name], job.text(), folders[name]) for name, job in jobs.items()}


def test_a_host_stalled_in_evaluation_is_named_by_every_host_and_the_job_resumes(ended_jobs):
  code, text, folder = ended_jobs["stuck"]
  assert code == 0, text[-3000:]
  first, second = text.split("[launcher] restart 1/1", 1)
  for host in (0, 1):  # Every host dumps its stacks, names host 1 and what it did, exits 69.
    assert re.search(rf"\[host {host}\] hetjax: watchdog: host {host}: no progress for", first)
    assert re.search(rf"\[host {host}\] (Current thread|Thread) 0x", first)
    assert re.search(rf"\[host {host}\] {re.escape(watchdog.MARKER)} 1$", first, re.M)
    assert re.search(rf"\[host {host}\] hetjax: watchdog: .*host\(s\) 1 did not keep up.* "
                     r"host 1: in evaluation at step 4 for \d+ s\.", first)
  assert " after host 1 stopped making progress: the step watchdog stopped the job" in second
  assert re.search(rf"\[host 0\] hetjax: resumed from {folder}/ckpt/2 ", second)
  assert "all hosts exited 0 after 1 restart" in second


def test_one_hosts_write_failing_in_orbaxs_background_commit_ends_every_host_with_74(ended_jobs):
  code, text, folder = ended_jobs["write"]
  assert code == supervise.WRITE_FAILED_EXIT == 74, text[-3000:]
  for host in (0, 1):  # Every host names host 1, the path and the error, then leaves with 74.
    assert (f"[host {host}] hetjax: host 1: cannot write checkpoint {folder}/ckpt/4: [Errno 28] "
            "No space left on device (emulated fault: host 1, step 4)") in text
    assert f"[host {host}] {ending.MARKERS[74]} 1" in text
  assert "[launcher] host 1 could not write a checkpoint (exit code 74" in text
  assert "not restarting (--max-restarts 1)" in text


def test_a_frozen_host_is_named_not_the_host_that_aborted_because_of_it(ended_jobs):
  code, text, _ = ended_jobs["frozen"]
  assert code == 128 + signal.SIGABRT, text[-3000:]
  assert ("[launcher] host 1 stopped responding: frozen, or its machine is unreachable (the "
          "coordination service got no heartbeat from it") in text
  assert "host 0 then ended with signal SIGABRT because of it" in text
  # Host 0's own early line (its watchdog thread reading the others' posts) is
  # best effort, a race with JAX's abort under load: its logic is tested above
  # on a recorded clock, not here.


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-x", "-q"]))
