"""Warm test hosts (tests/_warm_hosts.py): a forked host is the host a fresh process is.

What the harness sees must not change: each host its own process and
session, its own environment, folder and output; a host's exit code and
traceback reach `run_hosts`; the harness's signals reach the host; a killed
client takes its host with it; JAX variables the server was not started
with give a fresh interpreter.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import hetjax.testing
from hetjax.testing import run_hosts

import _warm_client
import _warm_hosts

pytestmark = pytest.mark.usefixtures("warm_hosts")


def _server_pid(socket_path: str) -> int:
  out = subprocess.run(["pgrep", "-f", f"_warm_hosts.py {socket_path}"],
                       capture_output=True, text=True).stdout.split()
  return int(out[0])


def test_forked_hosts_are_separate_processes_with_their_own_environment(warm_hosts):
  if warm_hosts is None:
    pytest.fail("this test checks the warm path: run it without HETJAX_TEST_COLD_HOSTS=1")
  out = run_hosts("_warm_entries:describe_process", hosts=2, devices_per_host=2,
                  host_env={1: {"HETJAX_TEST_MARK": "one"}})
  server = _server_pid(warm_hosts)
  pids = {o["pid"] for o in out}
  assert len(pids) == 2 and server not in pids
  assert all(o["ppid"] == server for o in out)  # Forked by the server, not started afresh.
  assert [o["index"] for o in out] == [0, 1] and all(o["devices"] == 2 for o in out)
  assert [o["mark"] for o in out] == [None, "one"]
  assert all(o["sid"] == o["pid"] for o in out)  # Each host leads its own session.
  assert _warm_hosts.PYTHON_ENV == hetjax.testing.PYTHON_ENV  # The hook the server plugs in.


def test_a_jax_variable_the_server_lacks_starts_a_fresh_interpreter(warm_hosts):
  out = run_hosts("_warm_entries:describe_process", hosts=1,
                  env={"JAX_DEFAULT_PRNG_IMPL": "threefry2x32"})
  assert out[0]["ppid"] != _server_pid(warm_hosts)


def test_a_failing_host_is_named_with_its_traceback():
  with pytest.raises(RuntimeError, match=r"(?s)host 1 of 2 failed.*ZeroDivisionError"):
    run_hosts("_warm_entries:fail_on_host_1", hosts=2)


def test_the_client_passes_sigterm_on_and_a_killed_client_kills_its_host(tmp_path):
  """Two clients started by hand, as the harness starts them; each host writes its pid."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HETJAX_CPU_DEVICES": "1"}
  started = []
  for name in ("term", "kill"):
    call = tmp_path / f"{name}.pkl"
    import pickle
    with open(call, "wb") as f:
      pickle.dump(("_warm_entries", "sleep_and_report", (str(tmp_path / f"{name}.pid"),), {}), f)
    started.append(subprocess.Popen([*_warm_client.module_command("hetjax.testing"), str(call),
                                     str(tmp_path / f"{name}.out")], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  pids = []
  for name in ("term", "kill"):
    path = tmp_path / f"{name}.pid"
    deadline = time.monotonic() + 120
    while not path.exists() or not path.read_text():
      assert time.monotonic() < deadline, f"the {name} host never started"
      time.sleep(0.05)
    pids.append(int(path.read_text()))
  term, kill = started
  term.send_signal(signal.SIGTERM)
  assert term.wait(60) == -signal.SIGTERM  # The host died of it; the client ends the same way.
  kill.kill()
  kill.wait(60)
  for pid in pids:
    deadline = time.monotonic() + 60
    while _alive(pid):
      assert time.monotonic() < deadline, f"host {pid} outlived its client"
      time.sleep(0.05)


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split()[2] != "Z"
  except FileNotFoundError:
    return False


def test_a_client_gone_before_its_answer_leaves_the_server_serving():
  """A client that dies between its request and the answer (a killed launcher) made the
  server raise BrokenPipeError and exit: every later host then waited for it."""
  import selectors
  import socket
  client, server_end = socket.socketpair()
  _warm_client.send_message(client, {"env": {}, "cwd": "/", "argv": ["-m", "json.tool"]})
  client.close()
  selector = selectors.DefaultSelector()
  selector.register(server_end, selectors.EVENT_READ, "request")
  # JAX variables that differ: the server answers "cold", to a client that has gone.
  _warm_hosts._answer(server_end, {"JAX_PLATFORMS": "cpu"}, {}, selector, None, -1, -1)  # pylint: disable=protected-access
  assert server_end.fileno() == -1  # Closed, and the server went on.


def test_a_client_finding_a_dead_servers_socket_starts_cold_after_a_short_grace(tmp_path):
  """A socket file that refuses belongs to a server that died: wait REFUSED_S, not CONNECT_S."""
  import socket
  path = str(tmp_path / "socket")
  dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  dead.bind(path)  # Bound, never listening: connect() is refused, as after the server's death.
  now, sleeps = [0.0], []

  def sleep(seconds):
    sleeps.append(seconds)
    now[0] += seconds

  try:
    assert _warm_client._connect(path, clock=lambda: now[0], sleep=sleep) is None  # pylint: disable=protected-access
  finally:
    dead.close()
  assert _warm_client.REFUSED_S <= now[0] <= _warm_client.REFUSED_S + 2 * _warm_client._POLL_S  # pylint: disable=protected-access
  # No socket yet (the server still importing JAX): the full CONNECT_S.
  now[0] = 0.0
  assert _warm_client._connect(str(tmp_path / "later"), clock=lambda: now[0], sleep=sleep) is None  # pylint: disable=protected-access
  assert now[0] >= _warm_client.CONNECT_S
