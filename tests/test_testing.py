"""`hetjax.testing.run_hosts`: real multi-process JAX on CPU, over gloo."""

from __future__ import annotations

import os

import pytest

from hetjax import testing
from hetjax.cluster import procs

# `_mh_entries` is importable as a top-level module when tests/ is a plain
# directory and as `tests._mh_entries` if it ever becomes a package.
_PACKAGE = __name__.rpartition(".")[0]
ENTRIES = f"{_PACKAGE}._mh_entries" if _PACKAGE else "_mh_entries"


def test_two_hosts_two_devices_join_one_collective_at_their_emulated_speeds():
  results = testing.run_hosts(f"{ENTRIES}:topology_and_sum", hosts=2, devices_per_host=2,
                              kwargs={"scale": 0.5}, speeds=[1.0, 0.5], timeout_s=120)
  # Devices of host i hold 0.5 * (i + 1): 0.5 * (1 + 1 + 2 + 2) on every host.
  assert results == [(0, 2, 2, 3.0, "1.0"), (1, 2, 2, 3.0, "0.5")]


def test_without_the_suites_warm_server_each_host_is_a_plain_interpreter_of_this_one():
  """What a user gets: `python -m hetjax.testing` started by this process, no harness."""
  out = testing.run_hosts("_warm_entries:describe_process", hosts=2, timeout_s=120,
                          env={testing.PYTHON_ENV: ""})
  assert [o["index"] for o in out] == [0, 1]
  assert all(o["ppid"] == os.getpid() for o in out)


def test_stragglers_and_faults_reach_every_host_as_the_launcher_gives_them():
  got = testing.run_hosts("_mh_entries:read_env", hosts=2, args=("HETJAX_FAULTS",),
                          faults="1:fail-write@4", timeout_s=120)
  assert got == ["1:fail-write@4"] * 2
  got = testing.run_hosts("_mh_entries:read_env", hosts=2, args=("HETJAX_SLOWDOWN",),
                          slowdown="1:3@5", timeout_s=120)
  assert got == ["1:3@5"] * 2


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
    ({"hosts": 2, "slowdown": "5:2@1"}, "names host 5 but there are 2 hosts"),
    ({"hosts": 2, "faults": "1:explode@3"}, "the kinds are fail-write"),
])
def test_bad_cluster_fails_before_any_process_starts(monkeypatch, kwargs, match):
  monkeypatch.setattr(procs, "run_group", _must_not_run)
  with pytest.raises(ValueError, match=match):
    testing.run_hosts(f"{ENTRIES}:topology_and_sum", **kwargs)


def _must_not_run(*args, **kwargs):
  raise AssertionError("a process was started")


def test_run_hosts_gives_each_host_its_own_environment():
  got = testing.run_hosts("_mh_entries:read_env", hosts=2, args=("HETJAX_TEST_MARK",),
                          host_env={1: {"HETJAX_TEST_MARK": "host-one"}})
  assert got == [None, "host-one"]
