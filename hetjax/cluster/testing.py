"""Multi-host tests on one CPU machine: run a function as N hetjax hosts.

    def entry():  # in an importable module, e.g. tests/_entries.py
      import jax
      return jax.process_index(), jax.process_count()

    def test_two_hosts():
      assert run_hosts("_entries:entry", hosts=2) == [(0, 2), (1, 2)]

Every host is a fresh Python process (`hetjax.cluster._testing_child`) that joins a
localhost cluster through `hetjax.cluster.runtime.initialize()` with the same
environment the launcher gives, so tests exercise the real multi-process path:
`jax.distributed`, gloo collectives, one process per host. Processes are
started, prefixed and stopped by `hetjax.cluster.procs`, exactly as the launcher does.

`kill_a_host_mid_run` is the other half of fault-tolerance tests: it runs a
launcher command, SIGKILLs one of its hosts (drawn from a fixed seed) as soon
as the first checkpoint is committed, and returns what the launcher said, so
a test can check the restart; a failure replays with the same seed.

This module imports no JAX; only the child processes do.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

from hetjax.cluster import procs
from hetjax.cluster import warm_client

# JAX catches SIGTERM once the distributed runtime is up (it treats it as a
# preemption notice), so a stopped host only really ends at SIGKILL; test
# hosts have nothing to save, so do not wait long for them.
_GRACE_S = 0.5
_ENTRY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def run_hosts(entry: str, *, hosts: int, devices_per_host: int = 1, args: tuple = (),
              kwargs: dict | None = None, speeds: Sequence[float] | None = None,
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
    speeds: optional emulated relative host speeds (HETJAX_SPEED).
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
                            init_timeout_s=min(timeout_s, 120.0), host_env=host_env)
  with tempfile.TemporaryDirectory(prefix="hetjax-run-hosts-") as tmp:
    call_path = os.path.join(tmp, "call.pkl")
    with open(call_path, "wb") as f:
      pickle.dump((module, function, tuple(args), dict(kwargs or {})), f)
    result_paths = [os.path.join(tmp, f"result-{i}.pkl") for i in range(hosts)]
    # Under a warm server (`warm_hosts`, the suite's conftest starts one) a
    # host is forked from an interpreter that imported JAX once.
    start = warm_client.command("hetjax.cluster._testing_child", base)
    commands = [[*start, call_path, path] for path in result_paths]
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


@dataclasses.dataclass(frozen=True)
class KilledRun:
  """What `kill_a_host_mid_run` did and what the launcher said."""
  seed: int      # Chose the victim: `seed=` replays the same kill; quote it in messages.
  victim: int    # The host that got SIGKILL.
  announced: int  # The newest committed checkpoint when the kill was sent: a resume starts
                  # there or later, never earlier.
  returncode: int
  stdout: str
  stderr: str


def kill_a_host_mid_run(command: Sequence[str], ckpt_dir: str | os.PathLike, *, hosts: int,
                        seed: int = 0, timeout_s: float = 600,
                        victim: int | None = None) -> KilledRun:
  """Runs a launcher `command`; SIGKILLs one host once a checkpoint is committed; waits for the end.

  The hosts announce a step by committing its checkpoint (orbax renames
  the step's folder into place only when every host wrote it): the kill is
  sent as soon as the first one appears in `ckpt_dir`, with no random
  delay, so the run is killed between that checkpoint and the next one (a
  few steps on), and `announced` says which. The victim is drawn from
  `seed` (the same one in every run unless the caller passes another), so a
  failure replays; `victim=` names it instead (host 0, which runs the
  coordination service, is the one whose loss the others cannot outlive
  quietly). The host is found in /proc by its `HETJAX_HOST_ID` and
  by `ckpt_dir` in its command line, so `command` must name the checkpoint
  folder and run `hetjax.cli` on every host (e.g. `launch/local.py
  --max-restarts 2 -- python -m hetjax.cli train ...`).

  Raises:
    ValueError: `ckpt_dir` is not in `command`, before anything starts.
    RuntimeError: this machine has no /proc (Linux only), before anything starts.
    AssertionError: the run ends before the first checkpoint, or the host is
      not found or exits before the kill; the launcher's stderr tail and the
      seed are in the message.
  """
  if not os.path.isdir("/proc"):
    raise RuntimeError("kill_a_host_mid_run finds the host processes in /proc, which this "
                       "machine lacks; run it on Linux.")
  ckpt_dir = os.fspath(ckpt_dir)
  if not any(ckpt_dir in part for part in command):
    raise ValueError(f"the command must name the checkpoint folder {ckpt_dir!r} (it finds the "
                     "host processes by it); pass the same folder as --ckpt-dir.")
  if victim is None:
    victim = random.Random(seed).randrange(hosts)
  elif not 0 <= victim < hosts:
    raise ValueError(f"victim must be a host of the run, 0..{hosts - 1}; got {victim!r}.")
  proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + timeout_s
    while not (announced := _committed_steps(ckpt_dir)):
      if proc.poll() is not None or time.monotonic() > deadline:
        raise AssertionError(f"seed {seed}: the run ended or timed out before its first "
                             f"checkpoint: {proc.communicate()[1][-3000:]}")
      time.sleep(0.05)  # A poll: what it waits for is the checkpoint, not a time.
    pid = host_pid(victim, ckpt_dir)
    if pid is None:
      raise AssertionError(f"seed {seed}: host {victim} not found in /proc after checkpoint "
                           f"{max(announced)}")
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # It exited between the lookup and the kill.
      raise AssertionError(f"seed {seed}: host {victim} (pid {pid}) exited before the kill "
                           f"after checkpoint {max(announced)}; the run was not killed mid-run "
                           f"(it finished, or failed on its own): "
                           f"{proc.communicate()[1][-3000:]}") from None
    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return KilledRun(seed, victim, max(announced), proc.returncode, out, err)


def _committed_steps(ckpt_dir: str) -> list[int]:
  """Steps whose checkpoint orbax has committed (in-progress ones carry a suffix)."""
  try:
    return [int(p) for p in os.listdir(ckpt_dir) if p.isdigit()]
  except FileNotFoundError:
    return []


def killed_and_uninterrupted(launch: Callable[..., Sequence[str]], folder: str | os.PathLike, *,
                             hosts: int, seed: int = 0, victim: int | None = None
                             ) -> tuple[KilledRun, dict[str, Any], dict[str, Any]]:
  """The same training twice: uninterrupted, and with one host killed mid-run.

  `launch(ckpt, out, extra=())` is the launcher command of one run; the
  killed run gets `("--max-restarts", "2")` as `extra`, the uninterrupted
  one `ckpt=None`: the same training without checkpoints (saving must not
  change the result, and it is work that nothing reads). Both runs live in
  `folder`. `victim` as in `kill_a_host_mid_run`. Returns the killed run and both runs' summary.json, after
  checking that both finished and that the launcher restarted the killed
  host: what is left to compare is the caller's.
  """
  folder = os.fspath(folder)
  # The reference runs beside the killed run: they share nothing but the
  # machine, and neither's result depends on how fast the other goes (the
  # kill waits for a checkpoint, not for a time), so one wall time, not two.
  with open(os.path.join(folder, "ref.log"), "w+") as ref_log:
    reference = subprocess.Popen(
        list(launch(None, os.path.join(folder, "ref"))),
        stdout=ref_log, stderr=subprocess.STDOUT)
    try:
      ckpt, out = os.path.join(folder, "ckpt"), os.path.join(folder, "run")
      run = kill_a_host_mid_run(launch(ckpt, out, ("--max-restarts", "2")), ckpt, hosts=hosts,
                                seed=seed, victim=victim)
      assert run.returncode == 0, f"seed {run.seed}: {run.stderr[-3000:]}"
      assert f"restart 1/2 after host {run.victim} failed with signal SIGKILL" in run.stderr, (
          f"seed {run.seed}: {run.stderr[-3000:]}")
      returncode = reference.wait(timeout=600)
    finally:
      if reference.poll() is None:  # Only when the killed run failed: stop the launcher,
        reference.terminate()       # which stops its hosts.
        try:
          reference.wait(timeout=30)
        except subprocess.TimeoutExpired:
          reference.kill()
          reference.wait()
    ref_log.seek(0)
    assert returncode == 0, ref_log.read()[-3000:]
  summaries = []
  for name in (out, os.path.join(folder, "ref")):
    with open(os.path.join(name, "summary.json")) as f:
      summaries.append(json.load(f))
  resumed = summaries[0].get("resumed_from")
  assert resumed is not None and resumed >= run.announced, (
      f"seed {run.seed}: resumed from {resumed}, but checkpoint {run.announced} was committed "
      f"before host {run.victim} was killed: {run.stderr[-3000:]}")
  return run, summaries[0], summaries[1]


def host_pid(host: int, token: str) -> int | None:
  """The pid of hetjax.cli host `host` whose command line contains `token`, from /proc."""
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read().split(b"\0")
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read()
    except OSError:
      continue
    if token.encode() in cmd and f"HETJAX_HOST_ID={host}".encode() in env and b"hetjax.cli" in cmd:
      return int(entry)
  return None


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
