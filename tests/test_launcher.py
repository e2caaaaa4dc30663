"""`launch/local.py`: environment, output, failure, signals and no orphans.

Host commands are tiny `python -c` programs that carry a unique marker in
their argv, so a scan of /proc can prove that nothing they started survives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

LAUNCHER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "launch", "local.py")
# Generous bound on the launcher itself; tests never assert how fast it is.
DEADLINE_S = 60

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="scans /proc for orphans")


@pytest.fixture
def marker():
  """A unique argv token for this test's processes; kills leftovers on the way out."""
  token = f"hetjax-test-{uuid.uuid4().hex}"
  yield token
  for pid in _marked(token):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _marked(token: str) -> list[int]:
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
          cmdline = f.read()
      except OSError:
        continue
      if token.encode() in cmdline and int(entry) != os.getpid():
        pids.append(int(entry))
  return pids


def _assert_none_left(token: str) -> None:
  # SIGKILL is asynchronous, and a loaded 2-core machine may take seconds to tear processes
  # down; the hosts under test would otherwise live 120 s, so 30 s still tells them apart.
  for _ in range(600):
    if not _marked(token):
      return
    time.sleep(0.05)
  assert not _marked(token), "processes outlived the launcher"


def _host(code: str, token: str) -> list[str]:
  return [sys.executable, "-c", textwrap.dedent(code), token]


def _launch(launcher_args: list[str], host_cmd: list[str]) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, LAUNCHER, *launcher_args, "--", *host_cmd],
                        capture_output=True, text=True, timeout=DEADLINE_S)


def _start(launcher_args: list[str], host_cmd: list[str]) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, LAUNCHER, *launcher_args, "--", *host_cmd],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lines(proc: subprocess.Popen, needle: str, count: int) -> list[str]:
  seen = []
  while sum(needle in line for line in seen) < count:
    line = proc.stdout.readline()
    assert line, f"launcher output ended before {count} x {needle!r}: {seen}"
    seen.append(line)
  return seen


# A grandchild that ignores SIGTERM, so only the SIGKILL escalation stops it.
# Its host passes on its "grandchild up" line: a ready handshake, so the host
# never exits before the grandchild runs with SIGTERM ignored.
_SPAWN_STUBBORN_GRANDCHILD = """
  import subprocess, sys
  grandchild = subprocess.Popen(
      [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                             "print('grandchild up', flush=True); time.sleep(120)", sys.argv[1]],
      stdout=subprocess.PIPE, text=True)
  print(grandchild.stdout.readline().strip(), flush=True)
"""


def test_env_vars_reach_every_host_and_output_is_prefixed(marker):
  code = """
    import os, sys
    keys = ["HETJAX_COORDINATOR", "HETJAX_NUM_HOSTS", "HETJAX_HOST_ID", "HETJAX_CPU_DEVICES",
            "HETJAX_SPEED", "HETJAX_INIT_TIMEOUT", "PYTHONUNBUFFERED"]
    print("ENV " + " ".join(f"{k}={os.environ.get(k)}" for k in keys))
    print("to stderr", file=sys.stderr)
    print("no newline at the end", end="")
  """
  result = _launch(["--hosts", "3", "--devices-per-host", "2", "--speeds", "1,0.5,0.25",
                    "--init-timeout", "7"], _host(code, marker))
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert all(line.startswith("[host ") for line in lines), lines
  envs = {}
  for i in range(3):
    mine = [line for line in lines if line.startswith(f"[host {i}] ")]
    assert f"[host {i}] to stderr" in mine
    assert f"[host {i}] no newline at the end" in mine
    (env_line,) = [line for line in mine if " ENV " in line]
    envs[i] = dict(kv.split("=", 1) for kv in env_line.split(" ENV ", 1)[1].split())
  coordinators = {env["HETJAX_COORDINATOR"] for env in envs.values()}
  assert len(coordinators) == 1
  host, port = coordinators.pop().split(":")
  assert host == "127.0.0.1" and int(port) > 0
  for i, speed in enumerate([1.0, 0.5, 0.25]):
    assert envs[i]["HETJAX_HOST_ID"] == str(i)
    assert envs[i]["HETJAX_NUM_HOSTS"] == "3"
    assert envs[i]["HETJAX_CPU_DEVICES"] == "2"
    assert float(envs[i]["HETJAX_SPEED"]) == speed
    assert float(envs[i]["HETJAX_INIT_TIMEOUT"]) == 7
    assert envs[i]["PYTHONUNBUFFERED"] == "1"


def test_no_speed_variable_without_speeds(marker):
  code = "import os; print('SPEED', os.environ.get('HETJAX_SPEED'))"
  result = _launch(["--hosts", "2"], _host(code, marker))
  assert result.returncode == 0, result.stderr
  assert result.stdout.count("SPEED None") == 2


def test_failing_host_stops_the_others_and_is_named(marker):
  code = """
    import os, sys, time
    if os.environ["HETJAX_HOST_ID"] == "1":
      for k in range(30):
        print(f"line {k}")
      sys.exit(3)
    print("waiting", flush=True)
    time.sleep(120)
  """
  result = _launch(["--hosts", "3", "--grace", "1"], _host(code, marker))
  assert result.returncode == 3
  assert "host 1 failed with exit code 3" in result.stderr
  assert "stopped the other 2 hosts" in result.stderr
  tail = result.stderr.split("output lines of host 1:", 1)[1]
  assert "line 29" in tail and "line 10" in tail and "line 9\n" not in tail
  _assert_none_left(marker)


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_all_hosts(marker, signum, exit_code):
  code = _SPAWN_STUBBORN_GRANDCHILD + """
  import time
  print("ready", flush=True)
  time.sleep(120)
  """
  launcher = _start(["--hosts", "2", "--grace", "0.5"], _host(code, marker))
  try:
    _wait_for_lines(launcher, "ready", 2)
    assert len(_marked(marker)) >= 4  # The launcher's argv carries the marker too.
    launcher.send_signal(signum)
    launcher.wait(timeout=DEADLINE_S)
  finally:
    launcher.kill()
    launcher.communicate()
  assert launcher.returncode == exit_code
  _assert_none_left(marker)


# A host that reports which signal reached it and exits as a hetjax host
# would: 130 for Ctrl-C (a user's stop), 75 for SIGTERM (saved, restart me).
_REPORTS_ITS_SIGNAL = """
  import os, signal, sys, time
  def stop(signum, frame):
    print(f"got {signal.Signals(signum).name}", flush=True)
    sys.exit(130 if signum == signal.SIGINT else 75)
  signal.signal(signal.SIGINT, stop)
  signal.signal(signal.SIGTERM, stop)
  print("ready", flush=True)
  time.sleep(120)
"""


@pytest.mark.parametrize("hosts", [1, 2])
def test_ctrl_c_reaches_every_host_as_sigint_and_is_reported_as_a_user_stop(marker, hosts):
  launcher = _start(["--hosts", str(hosts), "--max-restarts", "3"],
                    _host(_REPORTS_ITS_SIGNAL, marker))
  try:
    _wait_for_lines(launcher, "ready", hosts)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=DEADLINE_S)
  finally:
    launcher.kill()
  assert launcher.returncode == 130
  assert [f"[host {i}] got SIGINT" in out for i in range(hosts)] == [True] * hosts
  assert "SIGTERM" not in out
  ends = ", ".join(f"host {i} exit code 130" for i in range(hosts))
  assert f"[launcher] stopped by the user (Ctrl-C, SIGINT); all {hosts} hosts stopped ({ends})." in err
  assert "restart 1/" not in err and "preempt" not in err
  _assert_none_left(marker)


def test_sigterm_to_the_launcher_reaches_the_hosts_as_sigterm(marker):
  launcher = _start(["--hosts", "2", "--max-restarts", "3"], _host(_REPORTS_ITS_SIGNAL, marker))
  try:
    _wait_for_lines(launcher, "ready", 2)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=DEADLINE_S)
  finally:
    launcher.kill()
  assert launcher.returncode == 128 + signal.SIGTERM
  assert "[host 0] got SIGTERM" in out and "[host 1] got SIGTERM" in out
  assert "received SIGTERM; all 2 hosts stopped (host 0 exit code 75, host 1 exit code 75)." in err
  assert "restart 1/" not in err
  _assert_none_left(marker)


def test_a_second_ctrl_c_kills_hosts_that_do_not_stop(marker):
  code = """
    import signal, time
    signal.signal(signal.SIGINT, lambda *a: print("ignoring SIGINT", flush=True))
    print("ready", flush=True)
    time.sleep(120)
    time.sleep(120)
  """
  launcher = _start(["--hosts", "2"], _host(code, marker))
  try:
    _wait_for_lines(launcher, "ready", 2)
    launcher.send_signal(signal.SIGINT)
    _wait_for_lines(launcher, "ignoring SIGINT", 2)  # Both got it and run on.
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=DEADLINE_S)
  finally:
    launcher.kill()
  assert launcher.returncode == 130
  assert "Ctrl-C again to kill them now" in err
  # Killed at once: SIGTERM then SIGKILL, no grace; either may land first.
  assert re.search(r"all 2 hosts stopped \(host 0 signal SIG(TERM|KILL), host 1 signal SIG(TERM|KILL)\)",
                   err), err
  _assert_none_left(marker)


def test_a_host_that_was_stopped_by_the_user_is_not_restarted(marker):
  code = "import os, sys; sys.exit(130 if os.environ['HETJAX_HOST_ID'] == '0' else 0)"
  result = _launch(["--hosts", "2", "--max-restarts", "3"], _host(code, marker))
  assert result.returncode == 130
  assert "host 0 was stopped by the user (exit code 130)" in result.stderr
  assert "restart 1/3" not in result.stderr


@pytest.mark.parametrize("hosts", [1, 2])
def test_hosts_and_what_they_started_die_with_a_sigkilled_launcher(marker, hosts):
  code = _SPAWN_STUBBORN_GRANDCHILD + """
  import time
  print("ready", flush=True)
  time.sleep(120)
  """
  launcher = _start(["--hosts", str(hosts)], _host(code, marker))
  try:
    _wait_for_lines(launcher, "ready", hosts)
    assert len(_marked(marker)) >= 1 + 2 * hosts  # The launcher, hosts and grandchildren.
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=DEADLINE_S)
  finally:
    launcher.kill()
    launcher.communicate()
  _assert_none_left(marker)


# Host 1 ends first; host 0 waits until host 1 is gone (a zombie: the launcher
# has not reaped it), then ends as a peer of a dead host would. Host 0 has the
# lower index, so a launcher that blames the lowest index it finds dead in one
# poll gets it wrong whenever both end in the same poll.
_DIES_AFTER_HOST_1 = """
  import os, signal, sys, time
  pid_file, how_1, how_0 = sys.argv[2], sys.argv[3], sys.argv[4]
  def end(how):
    if how == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    if how == "abort":
      os.abort()
    sys.exit(int(how))
  if os.environ["HETJAX_HOST_ID"] == "1":
    with open(pid_file + ".tmp", "w") as f:
      f.write(str(os.getpid()))
    os.rename(pid_file + ".tmp", pid_file)
    end(how_1)
  while not os.path.exists(pid_file):
    time.sleep(0.001)
  pid = open(pid_file).read()
  def gone():
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
      return True
  while not gone():
    time.sleep(0.001)
  end(how_0)
"""


@pytest.mark.parametrize("how_1, how_0, expected", [
    ("kill", "1", "host 1 failed with signal SIGKILL"),
    ("75", "abort", "host 1 was preempted (exit code 75)"),
    ("3", "1", "host 1 failed with exit code 3"),
])
def test_the_host_that_ended_first_is_blamed_not_its_peer(tmp_path, marker, how_1, how_0, expected):
  for attempt in range(3):  # Three runs: each must blame host 1.
    pid_file = tmp_path / f"pid-{attempt}"
    result = _launch(["--hosts", "2"], [*_host(_DIES_AFTER_HOST_1, marker), str(pid_file), how_1,
                                        how_0])
    assert f"[launcher] {expected}; stopped the other host." in result.stderr, result.stderr


def test_first_failure_ranks_an_outside_kill_then_the_earliest_exit():
  from hetjax.cluster import procs
  # Host 1 SIGKILLed; host 0 died of it a moment later, or was even recorded first.
  assert procs.first_failure([1, -signal.SIGKILL], [2.0, 2.001]) == 1
  assert procs.first_failure([1, -signal.SIGKILL], [2.001, 2.0]) == 1
  # A preempted host exits 75; its peer aborts (SIGABRT, JAX's reaction) later.
  assert procs.first_failure([-signal.SIGABRT, 75], [3.0, 2.0]) == 1
  assert procs.first_failure([75, 4], [1.0, 1.5]) == 0
  assert procs.first_failure([75, 4], [1.5, 1.0]) == 1
  assert procs.first_failure([4, 75], [1.0, 1.0]) == 0
  assert procs.first_failure([75, 4], [1.0, 1.0]) == 1  # A tie: the failure outranks.
  assert procs.first_failure([None, 5], [None, 9.0]) == 1


def test_output_lines_end_at_carriage_returns_too():
  from hetjax.cluster import procs
  chunks = [b"a\nb\r\nc\rd", b"\r", b"\ne\r\rf\n\ng", b"\r\n\rstep 1\rstep 2\r", b"\xff"]
  assert list(procs.split_lines(chunks)) == ["a", "b", "c", "d", "e", "f", "", "g", "step 1",
                                             "step 2", "\ufffd"]


def test_grandchildren_die_even_when_every_host_succeeds(marker):
  code = _SPAWN_STUBBORN_GRANDCHILD
  result = _launch(["--hosts", "2", "--grace", "0.5"], _host(code, marker))
  assert result.returncode == 0, result.stderr
  assert result.stdout.count("grandchild up") == 2
  _assert_none_left(marker)


def test_grandchildren_die_when_a_host_fails(marker):
  code = _SPAWN_STUBBORN_GRANDCHILD + """
  import os, sys, time
  if os.environ["HETJAX_HOST_ID"] == "0":
    sys.exit(5)
  time.sleep(120)
  """
  result = _launch(["--hosts", "2", "--grace", "0.5"], _host(code, marker))
  assert result.returncode == 5
  assert "host 0 failed with exit code 5" in result.stderr
  _assert_none_left(marker)


def test_host_killed_by_a_signal_is_reported(marker):
  code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
  result = _launch(["--hosts", "1"], _host(code, marker))
  assert result.returncode == 128 + signal.SIGKILL
  assert "host 0 failed with signal SIGKILL" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--hosts", "0"], "(--hosts) must be an integer >= 1, got 0"),
    (["--hosts", "2", "--devices-per-host", "0"], "(--devices-per-host) must be an integer >= 1"),
    (["--hosts", "2", "--speeds", "1"], "--speeds gives 1 speed(s) (1) but there are 2 hosts"),
    (["--hosts", "2", "--speeds", "1,0"], "speed of host 1 must be in (0, 1]"),
    (["--hosts", "2", "--speeds", "1,1.5"], "speed of host 1 must be in (0, 1]"),
    (["--hosts", "2", "--speeds", "0.5,0.25"], "the fastest host has speed 1.0"),
    (["--hosts", "2", "--speeds", "1,fast"], "'fast' in '1,fast' is not a number"),
    (["--hosts", "2", "--init-timeout", "0"], "(--init-timeout) must be > 0 seconds"),
    (["--hosts", "2", "--grace", "-1"], "--grace must be >= 0 seconds"),
    (["--hosts", "2", "--max-restarts", "-1"], "--max-restarts must be an integer >= 0, got -1"),
    (["--hosts", "2", "--max-preemptions", "-2"], "--max-preemptions must be an integer >= 0"),
])
def test_bad_arguments_fail_before_any_host_starts(tmp_path, marker, args, message):
  witness = tmp_path / "started"
  result = _launch(args, _host(f"open({str(witness)!r}, 'w')", marker))
  assert result.returncode == 2
  assert message in result.stderr
  assert not witness.exists()


def test_missing_command_is_an_error():
  result = subprocess.run([sys.executable, LAUNCHER, "--hosts", "2", "--"],
                          capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 2
  assert "no host command given; put it after '--'" in result.stderr


def test_command_that_cannot_start(tmp_path):
  result = _launch(["--hosts", "2"], [str(tmp_path / "no-such-program")])
  assert result.returncode == 127
  assert "cannot start the host command" in result.stderr


def test_launcher_modules_import_no_jax():
  code = ("import sys; import hetjax.cluster.procs, hetjax.cluster.emulate, hetjax.testing; "
          "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy')); "
          "assert not heavy, heavy")
  root = os.path.dirname(os.path.dirname(LAUNCHER))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=DEADLINE_S)


# Supervised restarts. Host 1 fails in the way under test until a flag file
# (its "checkpoint") exists; host 0 runs until stopped while the flag is
# missing, so a failed attempt always has a host to stop.
_FAIL_ONCE = """
  import os, signal, sys, time
  flag, how, always = sys.argv[2], sys.argv[3], sys.argv[4] == "always"
  print(f"attempt {os.environ['HETJAX_RESTART_COUNT']} at {os.environ['HETJAX_COORDINATOR']}",
        flush=True)
  if os.environ["HETJAX_HOST_ID"] == "1" and (always or not os.path.exists(flag)):
    open(flag, "w").close()
    if how == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
  if not os.path.exists(flag):
    time.sleep(120)
"""


def _fail_once(marker: str, flag, how: str, always: bool = False) -> list[str]:
  return [*_host(_FAIL_ONCE, marker), str(flag), how, "always" if always else "once"]


def _attempts(stdout: str, host: int) -> list[str]:
  """The coordinator that `host` saw, per attempt, in order."""
  return [line.split(" at ")[1] for line in stdout.splitlines()
          if line.startswith(f"[host {host}] attempt ")]


@pytest.mark.parametrize("how, what", [("3", "host 1 failed with exit code 3"),
                                       ("kill", "host 1 failed with signal SIGKILL")])
def test_failed_job_is_restarted_and_succeeds(tmp_path, marker, how, what):
  result = _launch(["--hosts", "2", "--grace", "0.5", "--max-restarts", "2"],
                   _fail_once(marker, tmp_path / "flag", how))
  assert result.returncode == 0, result.stderr
  assert f"[launcher] restart 1/2 after {what}\n" in result.stderr
  assert "restart 2/2" not in result.stderr
  assert "all hosts exited 0 after 1 restart." in result.stderr
  # Host 0 may be stopped before it prints in the first attempt; host 1 always prints.
  first, second = _attempts(result.stdout, 1)
  assert first != second  # A new coordinator port for the new attempt.
  assert _attempts(result.stdout, 0)[-1] == second  # HETJAX_RESTART_COUNT counts.
  assert "[host 0] attempt 1 at " in result.stdout
  _assert_none_left(marker)


@pytest.mark.parametrize("how, code, what", [
    ("4", 4, "host 1 failed with exit code 4"),
    ("kill", 128 + signal.SIGKILL, "host 1 failed with signal SIGKILL")])
def test_gives_up_after_max_restarts_with_the_last_failure(tmp_path, marker, how, code, what):
  result = _launch(["--hosts", "2", "--grace", "0.5", "--max-restarts", "2"],
                   _fail_once(marker, tmp_path / "flag", how, always=True))
  assert result.returncode == code
  assert f"restart 1/2 after {what}" in result.stderr
  assert f"restart 2/2 after {what}" in result.stderr
  assert (f"giving up after 2 restarts (--max-restarts 2); last failure: {what}; "
          f"exiting {code}.") in result.stderr
  assert len(_attempts(result.stdout, 1)) == 3
  _assert_none_left(marker)


def test_without_max_restarts_a_failure_is_final(tmp_path, marker):
  result = _launch(["--hosts", "2", "--grace", "0.5"], _fail_once(marker, tmp_path / "flag", "3"))
  assert result.returncode == 3
  assert "[launcher] restart" not in result.stderr and "giving up" not in result.stderr
  assert len(_attempts(result.stdout, 1)) == 1
  _assert_none_left(marker)


def test_preemption_restarts_without_using_up_max_restarts(tmp_path, marker):
  result = _launch(["--hosts", "2", "--grace", "0.5", "--max-restarts", "1"],
                   _fail_once(marker, tmp_path / "flag", "75"))
  assert result.returncode == 0, result.stderr
  assert ("[launcher] preemption restart 1/20 after host 1 was preempted (exit code 75)\n"
          in result.stderr)
  assert "restart 1/1" not in result.stderr
  assert "output lines of host 1" not in result.stderr  # A preemption is no error report.
  assert "all hosts exited 0 after 1 preemption restart." in result.stderr
  _assert_none_left(marker)


def test_preempted_run_without_restarts_exits_75_for_an_outer_scheduler(tmp_path, marker):
  result = _launch(["--hosts", "2", "--grace", "0.5"], _fail_once(marker, tmp_path / "flag", "75"))
  assert result.returncode == 75
  assert "host 1 was preempted (exit code 75); stopped the other host." in result.stderr
  assert "exiting 75 (preempted) so that an outer scheduler can requeue the job" in result.stderr
  assert len(_attempts(result.stdout, 1)) == 1
  _assert_none_left(marker)


def test_preemption_restarts_are_bounded(tmp_path, marker):
  result = _launch(["--hosts", "2", "--grace", "0.5", "--max-restarts", "5",
                    "--max-preemptions", "2"],
                   _fail_once(marker, tmp_path / "flag", "75", always=True))
  assert result.returncode == 75
  assert "preemption restart 2/2 after" in result.stderr
  assert ("giving up after 2 preemption restarts (--max-preemptions 2); last: host 1 was "
          "preempted (exit code 75); exiting 75.") in result.stderr
  assert "restart 1/5" not in result.stderr
  assert len(_attempts(result.stdout, 1)) == 3
  _assert_none_left(marker)


def test_a_failure_outranks_a_preemption_seen_at_the_same_time():
  from hetjax.cluster import procs
  assert procs.first_failure([None, 0, None]) is None
  assert procs.first_failure([75, None, 3]) == 2
  assert procs.first_failure([75, 75]) == 0
  assert procs.first_failure([0, -9, 75]) == 1


def test_supervise_counts_failures_and_preemptions_apart(capsys):
  from hetjax.cluster import procs
  ends = {"ok": 0, "fail": 3, "preempted": procs.PREEMPTED_EXIT, "killed": -signal.SIGKILL}

  def run(script, **budgets):
    seen = []

    def attempt(restart_count):
      seen.append(restart_count)
      code = ends[script[len(seen) - 1]]
      return procs.Outcome([code, None], failed_host=None if code == 0 else 0,
                           tails=[["last words"], []])

    return procs.supervise(attempt, **budgets), seen

  assert run(["preempted", "fail", "preempted", "ok"], max_restarts=1) == (0, [0, 1, 2, 3])
  assert run(["fail", "killed"], max_restarts=1) == (128 + signal.SIGKILL, [0, 1])
  assert run(["preempted"]) == (procs.PREEMPTED_EXIT, [0])
  assert run(["preempted", "ok"], max_preemptions=1) == (0, [0, 1])
  assert run(["fail"], max_preemptions=5) == (3, [0])
  err = capsys.readouterr().err
  assert "restart 1/1 after host 0 failed with exit code 3" in err
  assert "last failure: host 0 failed with signal SIGKILL; exiting 137." in err
  interrupted = procs.Outcome([None, None], signal=signal.SIGINT)
  assert procs.supervise(lambda n: interrupted, max_restarts=3) == 130
  with pytest.raises(ValueError, match="--max-restarts must be an integer >= 0, got -1"):
    procs.supervise(lambda n: interrupted, max_restarts=-1)
