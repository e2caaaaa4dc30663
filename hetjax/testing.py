"""Multi-host tests on one CPU machine: a function run as N unlike hetjax hosts.

    def entry():  # in an importable module, e.g. tests/_entries.py
      import jax
      return jax.process_index(), jax.process_count()

    def test_two_hosts():
      assert run_hosts("_entries:entry", hosts=2) == [(0, 2), (1, 2)]

Each host is a fresh process (`python -m hetjax.testing`) joining a localhost cluster through
`runtime.initialize()`, started and stopped by `hetjax.cluster.procs` as the launcher does: the
real multi-process path (`jax.distributed`, gloo). Hosts can be made unlike (EMULATED,
`hetjax.cluster.emulate`). `HETJAX_TESTING_PYTHON` replaces the interpreter (the suite forks
hosts from a warm server: tests/_warm_hosts.py). This module imports no JAX.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import shlex
import sys
import tempfile
import traceback
from typing import Any, Mapping, Sequence

from hetjax.cluster import emulate, procs
from hetjax.config import Env

PYTHON_ENV = "HETJAX_TESTING_PYTHON"
# JAX takes SIGTERM as a preemption notice, so a host ends only at SIGKILL; nothing to save.
_GRACE_S = 0.5
_ENTRY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def run_hosts(entry: str, *, hosts: int, devices_per_host: int = 1, args: tuple = (),
              kwargs: dict | None = None, speeds: Sequence[float] | None = None,
              slowdown: str | None = None, faults: str | None = None,
              timeout_s: float = 300, env: Mapping[str, str] | None = None,
              host_env: Mapping[int, Mapping[str, str]] | None = None,
              quiet: bool = False) -> list[Any]:
  """Calls `module:function` on every host of a localhost cluster.

  Args:
    entry: `"package.module:function"`; the function must be module-level and
      importable from this process's `sys.path` (children get it as PYTHONPATH).
    hosts: number of host processes.
    devices_per_host: emulated CPU devices per host.
    args: positional arguments for the function (pickled).
    kwargs: keyword arguments for the function (pickled).
    speeds: emulated relative host speeds, the fastest 1.0 (HETJAX_SPEED).
    slowdown: emulated stragglers, `HOST:FACTOR@STEP,...` (HETJAX_SLOWDOWN).
    faults: emulated faults, `HOST:KIND@STEP,...` with KIND `stall-in-PHASE`,
      `stall-in-step` or `fail-write` (HETJAX_FAULTS).
    timeout_s: deadline for the whole run, joining the cluster included.
    env: extra environment variables for every host.
    host_env: extra variables per host, {host: {key: value}}: emulates hosts
      that differ, e.g. `{1: {"XLA_FLAGS": "--xla_backend_optimization_level=0"}}`
      compiles host 1's programs differently.
    quiet: keep the hosts' output, instead of printing it to stderr as it
      comes, for a failure's message, which quotes its last lines.

  Returns:
    The function's return value on each host, in host order.

  Raises:
    ValueError: a bad entry, cluster shape or emulation, before any process starts.
    RuntimeError: a host failed (named, with its traceback) or `timeout_s` passed; all stopped.
  """
  module, function = _check_entry(entry)
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}.")
  base = dict(os.environ)
  base.update(env or {})
  if faults:
    emulate.parse_faults(faults)  # Named before any process starts.
    base[Env.FAULTS] = faults
  # Children must import what this process imports, e.g. test helper modules
  # that pytest made importable by editing sys.path.
  base["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
  envs = procs.cluster_envs(hosts, devices_per_host, speeds=speeds, base=base, slowdown=slowdown,
                            init_timeout_s=min(timeout_s, 120.0), host_env=host_env)
  python = shlex.split(base.get(PYTHON_ENV) or "") or [sys.executable]
  with tempfile.TemporaryDirectory(prefix="hetjax-run-hosts-") as tmp:
    call_path = os.path.join(tmp, "call.pkl")
    with open(call_path, "wb") as f:
      pickle.dump((module, function, tuple(args), dict(kwargs or {})), f)
    result_paths = [os.path.join(tmp, f"result-{i}.pkl") for i in range(hosts)]
    commands = [[*python, "-m", "hetjax.testing", call_path, path] for path in result_paths]
    outcome = procs.run_group(commands, envs, sink=None if quiet else sys.stderr,
                              timeout_s=timeout_s, grace_s=_GRACE_S)
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


def _write(path: str, payload: tuple) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    pickle.dump(payload, f)
  os.replace(tmp, path)  # The parent never reads half a file.


def _host(call_path: str, result_path: str) -> int:
  """One host: join the cluster, call, write `("ok", value)` or `("error", traceback)`."""
  try:
    with open(call_path, "rb") as f:
      module, function, args, kwargs = pickle.load(f)
    from hetjax.cluster import runtime  # pylint: disable=g-import-not-at-top
    runtime.initialize()
    value = getattr(importlib.import_module(module), function)(*args, **kwargs)
    payload = ("ok", value)
    pickle.dumps(payload)  # Fail here, with a traceback, if the value cannot travel.
  except BaseException:  # pylint: disable=broad-except
    _write(result_path, ("error", traceback.format_exc()))
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip atexit: JAX's distributed shutdown waits for every other host, and
    # they may be blocked in a collective that this host will never join.
    os._exit(1)  # pylint: disable=protected-access
  _write(result_path, payload)
  return 0


if __name__ == "__main__":
  sys.exit(_host(*sys.argv[1:]))
