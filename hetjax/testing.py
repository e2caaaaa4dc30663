"""Multi-host tests on one CPU machine: run a function as N hetjax hosts.

    def entry():  # in an importable module, e.g. tests/_entries.py
      import jax
      return jax.process_index(), jax.process_count()

    def test_two_hosts():
      assert run_hosts("_entries:entry", hosts=2) == [(0, 2), (1, 2)]

Every host is a fresh Python process (`hetjax._testing_child`) that joins a
localhost cluster through `hetjax.runtime.initialize()` with the same
environment the launcher gives, so tests exercise the real multi-process path:
`jax.distributed`, gloo collectives, one process per host. Processes are
started, prefixed and stopped by `hetjax.procs`, exactly as the launcher does.

This module imports no JAX; only the child processes do.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
import tempfile
from typing import Any, Mapping, Sequence

from hetjax import procs

# JAX catches SIGTERM once the distributed runtime is up (it treats it as a
# preemption notice), so a stopped host only really ends at SIGKILL; test
# hosts have nothing to save, so do not wait long for them.
_GRACE_S = 0.5
_ENTRY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def run_hosts(entry: str, *, hosts: int, devices_per_host: int = 1, args: tuple = (),
              kwargs: dict | None = None, speeds: Sequence[float] | None = None,
              timeout_s: float = 300, env: Mapping[str, str] | None = None) -> list[Any]:
  """Calls `module:function` on every host of a localhost cluster.

  Args:
    entry: `"package.module:function"`; the function must be module-level and
      importable from this process's `sys.path` (children get it as PYTHONPATH).
    hosts: number of host processes.
    devices_per_host: emulated CPU devices per host.
    args: positional arguments for the function (pickled).
    kwargs: keyword arguments for the function (pickled).
    speeds: optional emulated relative host speeds (HETJAX_SPEED).
    timeout_s: deadline for the whole run, joining the cluster included.
    env: extra environment variables for every host.

  Returns:
    The function's return value on each host, in host order.

  Raises:
    ValueError: on a bad entry or cluster shape, before any process starts.
    RuntimeError: when a host fails (naming it, with its traceback) or the
      run exceeds `timeout_s`; all hosts are stopped first.
  """
  module, function = _check_entry(entry)
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}.")
  base = dict(os.environ)
  base.update(env or {})
  # Children must import what this process imports, e.g. test helper modules
  # that pytest made importable by editing sys.path.
  base["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
  envs = procs.cluster_envs(hosts, devices_per_host, speeds=speeds, base=base,
                            init_timeout_s=min(timeout_s, 120.0))
  with tempfile.TemporaryDirectory(prefix="hetjax-run-hosts-") as tmp:
    call_path = os.path.join(tmp, "call.pkl")
    with open(call_path, "wb") as f:
      pickle.dump((module, function, tuple(args), dict(kwargs or {})), f)
    result_paths = [os.path.join(tmp, f"result-{i}.pkl") for i in range(hosts)]
    commands = [[sys.executable, "-m", "hetjax._testing_child", call_path, path]
                for path in result_paths]
    outcome = procs.run_group(commands, envs, sink=sys.stderr, timeout_s=timeout_s,
                               grace_s=_GRACE_S)
    results = [_load(path) for path in result_paths]
  if outcome.timed_out:
    done = [i for i, r in enumerate(results) if r is not None]
    raise RuntimeError(f"run_hosts({entry!r}) timed out after timeout_s={timeout_s:g} s with "
                       f"{hosts} hosts (finished: {done or 'none'}); stopped all hosts. A host "
                       f"that waits in a collective for a host that never arrives hangs; "
                       f"raise timeout_s if the work is just slow.{_tails(outcome)}")
  if not outcome.ok:
    raise RuntimeError(_failure(entry, outcome, results))
  return [value for _, value in results]


def _check_entry(entry: str) -> tuple[str, str]:
  """Splits and resolves `module:function` here, so a typo fails before any spawn."""
  if not isinstance(entry, str) or not _ENTRY_RE.match(entry):
    raise ValueError(f"entry must be 'module:function' with a module-level function, e.g. "
                     f"'tests._entries:two_hosts', got {entry!r}.")
  module_name, function = entry.split(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"entry {entry!r}: cannot import module {module_name!r} ({e}); it must "
                     "be importable from sys.path.") from e
  if not callable(getattr(module, function, None)):
    raise ValueError(f"entry {entry!r}: module {module_name!r} has no function {function!r}.")
  return module_name, function


def _load(path: str) -> tuple[str, Any] | None:
  try:
    with open(path, "rb") as f:
      return pickle.load(f)
  except FileNotFoundError:
    return None


def _failure(entry: str, outcome: procs.Outcome, results: list) -> str:
  host = outcome.failed_host
  if host is None:  # Only a signal to this process gets here.
    return f"run_hosts({entry!r}): {procs.describe(outcome)}"
  result = results[host]
  rc = outcome.returncodes[host]
  if result is not None and result[0] == "error":
    text = f"host {host} of {len(results)} failed in {entry} (exit code {rc}):\n{result[1]}"
  else:
    text = f"run_hosts({entry!r}): {procs.describe(outcome)}"
  # Hosts that raised at about the same time: one of them may be the cause.
  for i, other in enumerate(results):
    if i != host and other is not None and other[0] == "error":
      text += f"\nhost {i} also failed: {other[1].strip().splitlines()[-1]}"
  return text


def _tails(outcome: procs.Outcome) -> str:
  text = ""
  for i, lines in enumerate(outcome.tails):
    if lines:
      text += f"\nLast output lines of host {i}:\n" + "\n".join(f"  {line}" for line in lines)
  return text
