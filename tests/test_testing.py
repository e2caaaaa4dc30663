"""`hetjax.testing.run_hosts`: real multi-process JAX on CPU, over gloo."""

from __future__ import annotations

import pytest

from hetjax.cluster import procs
from hetjax.cluster import testing

# `_mh_entries` is importable as a top-level module when tests/ is a plain
# directory and as `tests._mh_entries` if it ever becomes a package.
_PACKAGE = __name__.rpartition(".")[0]
ENTRIES = f"{_PACKAGE}._mh_entries" if _PACKAGE else "_mh_entries"


def test_two_hosts_two_devices_join_one_collective_and_share_one_compiled_program(tmp_path):
  cache = tmp_path / "xla-cache"
  env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "HETJAX_TEST_SHARE_PROGRAMS": "1"}
  for _ in range(2):  # The second cluster loads what the first compiled.
    results = testing.run_hosts(f"{ENTRIES}:topology_and_sum", hosts=2, devices_per_host=2,
                                kwargs={"scale": 0.5}, speeds=[1.0, 0.5], timeout_s=120, env=env)
    # Devices of host i hold 0.5 * (i + 1): 0.5 * (1 + 1 + 2 + 2) on every host.
    assert results == [(0, 2, 2, 3.0, "1.0"), (1, 2, 2, 3.0, "0.5")]
  # One program over the 4 devices: JAX alone keys it apart on each host (by
  # its topology fingerprint) and writes host 0's entry only; shared, one.
  entries = sorted(f.name for f in cache.iterdir() if f.name.startswith("jit_sum-"))
  assert len(entries) == 1, entries


def test_hosts_that_need_one_program_at_once_compile_it_once(tmp_path):
  """Host 1 runs on devices 2-3, host 0 on 0-1: one key, one compile, one load."""
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla-cache"), "HETJAX_TEST_SHARE_PROGRAMS": "1"}
  results = testing.run_hosts(f"{ENTRIES}:local_program_hits", hosts=2, devices_per_host=2,
                              timeout_s=120, env=env)
  assert sorted(hits for hits, _ in results) == [0, 1], results
  assert all(values == [1.0, 5.0, 12.0, 22.0] for _, values in results), results


def test_failing_host_is_named_with_its_traceback():
  with pytest.raises(RuntimeError) as info:
    testing.run_hosts(f"{ENTRIES}:fail_on_host", hosts=2, args=(1,), timeout_s=120)
  message = str(info.value)
  assert "host 1 of 2 failed" in message
  assert "ValueError: deliberate failure on host 1" in message
  assert "Traceback" in message


def test_a_quiet_host_that_dies_without_raising_is_quoted_in_the_message(capfd):
  with pytest.raises(RuntimeError) as info:
    # One host: no peer reacts to its death, so the blame is never in question.
    testing.run_hosts(f"{ENTRIES}:die_on_host", hosts=1, args=(0,), timeout_s=120, quiet=True)
  message = str(info.value)  # The launcher's words, with the failed host's last lines.
  assert "host 0 failed with exit code 3" in message and "\n  last words of host 0" in message
  assert "last words" not in capfd.readouterr().err  # Quiet: only the message has it.


def test_timeout_stops_everything_and_says_so():
  with pytest.raises(RuntimeError, match=r"timed out after timeout_s=3 s"):
    # The host sleeps far past the deadline.
    testing.run_hosts("time:sleep", hosts=1, args=(60,), timeout_s=3)


@pytest.mark.parametrize("entry, match", [
    ("no_colon_here", "'module:function'"),
    ("a:b:c", "'module:function'"),
    ("module:", "'module:function'"),
    ("mod:lambda x", "'module:function'"),
    ("hetjax_no_such_module_7f3a:f", "cannot import module 'hetjax_no_such_module_7f3a'"),
    (f"{ENTRIES}:no_such_function", "has no function 'no_such_function'"),
    (f"{ENTRIES}:os", "has no function 'os'"),  # A module attribute, not callable.
])
def test_bad_entry_fails_before_any_process_starts(monkeypatch, entry, match):
  monkeypatch.setattr(procs, "run_group", _must_not_run)
  with pytest.raises(ValueError, match=match):
    testing.run_hosts(entry, hosts=2)


@pytest.mark.parametrize("kwargs, match", [
    ({"hosts": 0}, r"\(--hosts\) must be an integer >= 1"),
    ({"hosts": 2, "devices_per_host": 0}, r"\(--devices-per-host\) must be an integer >= 1"),
    ({"hosts": 2, "speeds": [1.0]}, "one speed per host"),
    ({"hosts": 2, "timeout_s": 0}, "timeout_s must be > 0"),
])
def test_bad_cluster_fails_before_any_process_starts(monkeypatch, kwargs, match):
  monkeypatch.setattr(procs, "run_group", _must_not_run)
  with pytest.raises(ValueError, match=match):
    testing.run_hosts(f"{ENTRIES}:topology_and_sum", **kwargs)


def _must_not_run(*args, **kwargs):
  raise AssertionError("a process was started")


def test_kill_a_host_mid_run_refuses_a_command_without_the_checkpoint_folder(monkeypatch, tmp_path):
  import subprocess

  def no_process(*args, **kwargs):
    raise AssertionError("a process was started")
  monkeypatch.setattr(subprocess, "Popen", no_process)
  with pytest.raises(ValueError, match="must name the checkpoint folder .*ckpt.*--ckpt-dir"):
    testing.kill_a_host_mid_run(["launch/local.py", "--", "hetjax", "train"], tmp_path / "ckpt",
                                hosts=2)


def test_kill_a_host_mid_run_says_it_needs_proc_before_starting_anything(monkeypatch, tmp_path):
  real_isdir = testing.os.path.isdir
  monkeypatch.setattr(testing.os.path, "isdir", lambda p: False if p == "/proc" else real_isdir(p))
  monkeypatch.setattr(testing.subprocess, "Popen", _must_not_run)
  with pytest.raises(RuntimeError, match="finds the host processes in /proc"):
    testing.kill_a_host_mid_run(["--ckpt-dir", str(tmp_path)], tmp_path, hosts=2)


def test_run_hosts_gives_each_host_its_own_environment():
  got = testing.run_hosts("_mh_entries:read_env", hosts=2, args=("HETJAX_TEST_MARK",),
                          host_env={1: {"HETJAX_TEST_MARK": "host-one"}})
  assert got == [None, "host-one"]


class _FakeLauncher:
  """A launcher process that never ends by itself (the kill decides)."""

  def __init__(self, *args, **kwargs):
    self.returncode = None

  def poll(self):
    return self.returncode

  def communicate(self, timeout=None):
    self.returncode = -9 if self.returncode is None else self.returncode
    return "", "launcher stderr tail"

  def kill(self):
    self.returncode = -9


def _kill_with_fakes(monkeypatch, tmp_path, kill, **kwargs):
  (tmp_path / "20").mkdir(parents=True)                      # Committed: the announcement.
  (tmp_path / "40.orbax-checkpoint-tmp-1").mkdir()  # Still being written: not one.
  looked_up = []
  monkeypatch.setattr(testing.subprocess, "Popen", _FakeLauncher)
  monkeypatch.setattr(testing, "host_pid", lambda host, token: looked_up.append(host) or 4242)
  monkeypatch.setattr(testing.os, "kill", kill)
  run = testing.kill_a_host_mid_run(["--ckpt-dir", str(tmp_path)], tmp_path, hosts=5, **kwargs)
  return run, looked_up


def test_kill_a_host_mid_run_picks_the_same_victim_for_the_same_seed(monkeypatch, tmp_path):
  killed = []
  kill = lambda pid, sig: killed.append((pid, sig))
  runs = [_kill_with_fakes(monkeypatch, tmp_path / str(i), kill, seed=seed)[0]
          for i, seed in enumerate((0, 0, 7))]
  assert runs[0].seed == 0 and runs[0].victim == runs[1].victim  # Replays.
  assert [r.victim for r in runs] == [testing.random.Random(s).randrange(5) for s in (0, 0, 7)]
  assert all(r.announced == 20 for r in runs)
  assert killed == [(4242, testing.signal.SIGKILL)] * 3


def test_a_host_that_exits_before_the_kill_is_reported_not_raised_as_lookup_error(
    monkeypatch, tmp_path):
  def gone(pid, sig):
    raise ProcessLookupError(pid)
  with pytest.raises(AssertionError, match=r"seed 3: host \d \(pid 4242\) exited before the kill "
                                           r"after checkpoint 20.*launcher stderr tail"):
    _kill_with_fakes(monkeypatch, tmp_path, gone, seed=3)
