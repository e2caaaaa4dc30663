"""Running N host processes: spawn, prefix output, stop trees, restart.

Shared by `launch/local.py`, `launch/hosts.py` (whose processes are the ssh
clients) and `hetjax.testing`, so the launchers that people use and the
harness that tests use stop processes in exactly the same way. `supervise`
restarts a whole group after a failure or a preemption (PREEMPTED_EXIT).

Every host runs in its own session (and so its own process group), which
lets us signal the host together with everything it started. Stopping is
SIGTERM to the group, a grace period for the host's main process to exit,
then SIGKILL to the group, so descendants that ignore SIGTERM die too. A
descendant that leaves the group on purpose (`setsid`) escapes; nothing
stdlib-only and portable can follow it.

Stdlib only: this module must never import JAX.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping, Sequence

from hetjax import emulate

# Mirrors hetjax.runtime, which cannot be imported here without JAX.
ENV_COORDINATOR = "HETJAX_COORDINATOR"
ENV_NUM_HOSTS = "HETJAX_NUM_HOSTS"
ENV_HOST_ID = "HETJAX_HOST_ID"
ENV_INIT_TIMEOUT = "HETJAX_INIT_TIMEOUT"
ENV_CPU_DEVICES = "HETJAX_CPU_DEVICES"
# How many times a launcher restarted the job before this attempt (for logs).
ENV_RESTART_COUNT = "HETJAX_RESTART_COUNT"

# A host that exits with this code was preempted and saved what it needs to
# resume: "restart me", not "I failed" (EX_TEMPFAIL from sysexits.h, which
# schedulers and shells already read as "try again later"). The trainer exits
# with it; the launchers restart on it or pass it on to an outer scheduler.
PREEMPTED_EXIT = 75
# Restarts after preemptions are not failures, so they have their own budget;
# a bound still stops a job that reports preemption at every start.
DEFAULT_MAX_PREEMPTIONS = 20

# A JAX host with the distributed runtime up treats SIGTERM as a preemption
# notice and keeps running, so the grace is the time a trainer that watches
# for preemption gets to react; after it, SIGKILL.
DEFAULT_GRACE_S = 5.0
TAIL_LINES = 20
_POLL_S = 0.05
# Signals that make the launcher stop its hosts; it then exits 128 + signum.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """A launcher's `ARGS -- COMMAND...` as (launcher arguments, host command)."""
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  return argv[:split], argv[split + 1:]


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def validate_cluster(hosts: int, devices_per_host: int, speeds: Sequence[float] | None = None,
                     init_timeout_s: float | None = None) -> list[float] | None:
  """Checks the shape of a local cluster before anything starts; returns the speeds."""
  if not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"the number of hosts (--hosts) must be an integer >= 1, got {hosts!r}.")
  if not isinstance(devices_per_host, int) or devices_per_host < 1:
    raise ValueError(f"devices per host (--devices-per-host) must be an integer >= 1, "
                     f"got {devices_per_host!r}.")
  if init_timeout_s is not None and not init_timeout_s > 0:
    raise ValueError(f"the init timeout (--init-timeout) must be > 0 seconds, "
                     f"got {init_timeout_s!r}.")
  return None if speeds is None else emulate.check_speeds(speeds, hosts)


def cluster_envs(hosts: int, devices_per_host: int, *, speeds: Sequence[float] | None = None,
                 init_timeout_s: float | None = None, base: Mapping[str, str] | None = None,
                 coordinator: str | None = None, slowdown: str | None = None,
                 device_sample_ms: float | None = None) -> list[dict[str, str]]:
  """One environment per host, as `hetjax.runtime.initialize()` reads it.

  Args:
    hosts: number of host processes.
    devices_per_host: emulated CPU devices per host.
    speeds: optional emulated relative speeds, one per host (HETJAX_SPEED).
    init_timeout_s: optional bound on joining the cluster (HETJAX_INIT_TIMEOUT).
    base: environment to extend; defaults to this process's.
    coordinator: `host:port`; defaults to a free port on 127.0.0.1.
    slowdown: optional emulated stragglers, `HOST:FACTOR@STEP,...` (HETJAX_SLOWDOWN).
    device_sample_ms: optional emulated device milliseconds per sample on the
      fastest host (HETJAX_DEVICE_SAMPLE_MS).

  Returns:
    A list of `hosts` complete environments.
  """
  speeds = validate_cluster(hosts, devices_per_host, speeds, init_timeout_s)
  if device_sample_ms is not None:
    emulate.sample_ms_from_env({emulate.ENV_DEVICE_SAMPLE_MS: str(device_sample_ms)})
  for s in emulate.parse_slowdowns(slowdown or ""):
    if s.host >= hosts:
      raise ValueError(f"--slowdown names host {s.host} but there are {hosts} hosts (0..{hosts - 1}).")
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  envs = []
  for i in range(hosts):
    env = dict(os.environ if base is None else base)
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_HOSTS: str(hosts), ENV_HOST_ID: str(i),
                ENV_CPU_DEVICES: str(devices_per_host), "PYTHONUNBUFFERED": "1"})
    if init_timeout_s is not None:
      env[ENV_INIT_TIMEOUT] = f"{init_timeout_s:g}"
    if speeds is not None:
      env[emulate.ENV_SPEED] = repr(speeds[i])
    if slowdown:
      env[emulate.ENV_SLOWDOWN] = slowdown
    if device_sample_ms is not None:
      env[emulate.ENV_DEVICE_SAMPLE_MS] = repr(float(device_sample_ms))
    envs.append(env)
  return envs


@dataclasses.dataclass
class Outcome:
  """How a group of hosts ended.

  Attributes:
    returncodes: per host; negative means killed by that signal.
    failed_host: the first host seen exiting non-zero, if any.
    signal: the signal that made us stop the hosts, if any.
    timed_out: whether the hosts were stopped because of a deadline.
    tails: the last output lines of each host.
  """

  returncodes: list[int | None]
  failed_host: int | None = None
  signal: int | None = None
  timed_out: bool = False
  tails: list[list[str]] = dataclasses.field(default_factory=list)

  @property
  def ok(self) -> bool:
    return self.failed_host is None and self.signal is None and not self.timed_out

  @property
  def preempted(self) -> bool:
    """Whether the hosts stopped because one was preempted (exit PREEMPTED_EXIT), not failed."""
    return (self.signal is None and not self.timed_out and self.failed_host is not None
            and self.returncodes[self.failed_host] == PREEMPTED_EXIT)

  def exit_code(self) -> int:
    """A shell-style exit code: 0, the failed host's code, or 128 + signal."""
    if self.signal is not None:
      return 128 + self.signal
    if self.timed_out:
      return 124  # As timeout(1) does.
    if self.failed_host is not None:
      rc = self.returncodes[self.failed_host] or 1
      return rc if rc > 0 else 128 - rc
    return 0


class HostGroup:
  """N host processes, each in its own process group, output prefixed by host."""

  def __init__(self, commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
               sink: IO[str] | None = None, tail_lines: int = TAIL_LINES,
               cwd: str | None = None):
    if len(commands) != len(envs):
      raise ValueError(f"got {len(commands)} commands but {len(envs)} environments.")
    self._commands = [list(c) for c in commands]
    self._envs = [dict(e) for e in envs]
    self._sink = sink
    self._cwd = cwd
    self._lock = threading.Lock()
    self.procs: list[subprocess.Popen] = []
    self.tails = [collections.deque(maxlen=tail_lines) for _ in commands]
    self._readers: list[threading.Thread] = []

  def start(self) -> None:
    """Starts every host; if one cannot start, stops those already running."""
    try:
      for i, (cmd, env) in enumerate(zip(self._commands, self._envs)):
        proc = subprocess.Popen(cmd, env=env, cwd=self._cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        reader = threading.Thread(target=self._pump, args=(i, proc.stdout),
                                  name=f"hetjax-host-{i}-output", daemon=True)
        reader.start()
        self._readers.append(reader)
    except BaseException:
      self.stop(grace_s=0.0)
      raise

  def _pump(self, host: int, pipe: IO[bytes]) -> None:
    """Copies one host's output, line by line, prefixed, and keeps its tail."""
    prefix = f"[host {host}] "
    with pipe:
      for raw in iter(pipe.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        with self._lock:
          self.tails[host].append(line)
          if self._sink is not None:
            try:
              self._sink.write(prefix + line + "\n")
              self._sink.flush()
            except (OSError, ValueError):  # Closed or broken sink: keep draining the host.
              self._sink = None

  def poll(self) -> list[int | None]:
    """Exit codes of the hosts (None while running), without reaping them.

    An unreaped host keeps its pid, and so its process-group id, reserved
    until `stop`: the SIGKILL to the group can never hit a stranger that
    reused the number.
    """
    return [_peek(p) for p in self.procs]

  def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGTERM every host's group, wait up to `grace_s` for the hosts, then SIGKILL the groups.

    The groups are killed even when their main process has already exited,
    so nothing a host started outlives it.
    """
    for p in self.procs:
      _signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(rc is None for rc in self.poll()) and time.monotonic() < deadline:
      time.sleep(_POLL_S)
    for p in self.procs:
      _signal_group(p.pid, signal.SIGKILL)
    for p in self.procs:
      p.wait()  # Reaps only now, after the last signal to its group.

  def join_output(self, timeout_s: float = 5.0) -> None:
    """Waits for the output of stopped hosts to drain (bounded: escapees hold pipes)."""
    deadline = time.monotonic() + timeout_s
    for reader in self._readers:
      reader.join(max(0.0, deadline - time.monotonic()))

  def tail(self, host: int) -> list[str]:
    with self._lock:
      return list(self.tails[host])


def run_group(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
              sink: IO[str] | None = None, timeout_s: float | None = None,
              grace_s: float = DEFAULT_GRACE_S, handle_signals: bool = False,
              tail_lines: int = TAIL_LINES) -> Outcome:
  """Runs one process per host until all exit 0, one fails, a deadline or a signal.

  On the first failure (or timeout, or signal) every other host is stopped.
  Either way, every host's process group is killed before this returns.

  Args:
    commands: the argv of each host.
    envs: the environment of each host.
    sink: where prefixed output lines go (None: only kept as tails).
    timeout_s: optional deadline for the whole group.
    grace_s: how long stopped hosts get between SIGTERM and SIGKILL.
    handle_signals: catch SIGINT / SIGTERM / SIGHUP while running (main
      thread only) to stop the hosts instead of dying and orphaning them.
    tail_lines: how many last output lines to keep per host.

  Returns:
    The `Outcome`.
  """
  received: list[int] = []
  previous = _install_handlers(received) if handle_signals else {}
  group = HostGroup(commands, envs, sink=sink, tail_lines=tail_lines)
  outcome = Outcome(returncodes=[None] * len(commands))
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  try:
    group.start()
    while True:
      codes = group.poll()
      failed = first_failure(codes)
      if received:
        outcome.signal = received[0]
      elif failed is not None:
        outcome.failed_host = failed
      elif all(rc == 0 for rc in codes):
        break
      elif deadline is not None and time.monotonic() > deadline:
        outcome.timed_out = True
      if not outcome.ok:
        break
      time.sleep(_POLL_S)
  finally:
    # Runs on success too: it kills whatever the hosts left behind.
    group.stop(grace_s)
    group.join_output()
    _restore_handlers(previous)
  outcome.returncodes = group.poll()
  outcome.tails = [group.tail(i) for i in range(len(commands))]
  return outcome


def first_failure(codes: Sequence[int | None]) -> int | None:
  """The host to blame among those that exited non-zero by themselves, if any.

  A real failure outranks a preemption: restarting a crash as "preempted"
  would hide it from --max-restarts.
  """
  failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
  return next((i for i in failed if codes[i] != PREEMPTED_EXIT), failed[0] if failed else None)


def launch_local(command: Sequence[str], *, hosts: int, devices_per_host: int = 1,
                 speeds: Sequence[float] | None = None, init_timeout_s: float | None = None,
                 grace_s: float = DEFAULT_GRACE_S, sink: IO[str] | None = None,
                 slowdown: str | None = None, max_restarts: int = 0,
                 max_preemptions: int | None = None,
                 device_sample_ms: float | None = None) -> int:
  """Runs `command` as `hosts` hosts of a localhost cluster; returns the exit code.

  The code is 0 when every host exits 0, the last failing host's code when
  the job fails (after any restarts), and 128 + signal when the launcher
  itself is interrupted. What went wrong is printed to stderr. Every attempt
  gets a fresh coordinator port; see `supervise` for the restart rules.

  Raises:
    ValueError: on a bad argument, before anything starts.
  """
  if not command:
    raise ValueError("no host command given; put it after '--', e.g. "
                     "`--hosts 2 -- hetjax train --model cnn`.")
  check_restarts(max_restarts, max_preemptions)
  emulation = {"speeds": speeds, "slowdown": slowdown, "device_sample_ms": device_sample_ms}
  cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s,
               **emulation)  # Validates everything before the first start.

  def attempt(restart_count: int) -> Outcome:
    envs = cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s, **emulation)
    for env in envs:
      env[ENV_RESTART_COUNT] = str(restart_count)
    note(f"{hosts} host(s) x {devices_per_host} device(s), coordinator "
         f"{envs[0][ENV_COORDINATOR]}: {' '.join(command)}")
    return run_group([command] * hosts, envs, sink=sink or sys.stdout, grace_s=grace_s,
                     handle_signals=True)

  try:
    return supervise(attempt, max_restarts=max_restarts, max_preemptions=max_preemptions)
  except OSError as e:
    note(f"cannot start the host command {command[0]!r}: {e}")
    return 127 if isinstance(e, FileNotFoundError) else 126


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds --max-restarts and --max-preemptions, as every launcher spells them."""
  parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart all hosts up to K times after a host fails (default 0)")
  parser.add_argument("--max-preemptions", type=int, default=None, metavar="P",
                      help=f"restart all hosts up to P times after a preemption (a host exits "
                           f"{PREEMPTED_EXIT}), not counted in --max-restarts (default "
                           f"{DEFAULT_MAX_PREEMPTIONS} with --max-restarts, else 0: exit "
                           f"{PREEMPTED_EXIT} for an outer scheduler)")


def check_restarts(max_restarts: int, max_preemptions: int | None) -> None:
  """Raises ValueError on a restart budget that is not a count."""
  if not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}.")
  if max_preemptions is not None and (not isinstance(max_preemptions, int) or max_preemptions < 0):
    raise ValueError(f"--max-preemptions must be an integer >= 0, got {max_preemptions!r}.")


def supervise(attempt: Callable[[int], Outcome], *, max_restarts: int = 0,
              max_preemptions: int | None = None) -> int:
  """Runs `attempt` until the hosts succeed or the restart budgets are spent.

  Two budgets, because a preemption is not a failure:
  - a failure (a host exits non-zero, or dies by a signal) is restarted at
    most `max_restarts` times in all;
  - a preemption (the hosts stop with PREEMPTED_EXIT, having saved) is
    restarted at most `max_preemptions` times, without using up
    `max_restarts`. Its default is DEFAULT_MAX_PREEMPTIONS when
    `max_restarts > 0` and 0 otherwise, so a plain run that is preempted
    exits PREEMPTED_EXIT and an outer scheduler can requeue it.
  The launcher being interrupted, or a deadline, is never restarted.

  Args:
    attempt: starts all hosts, waits for them (`run_group`), returns how they
      ended; it gets the number of restarts so far.
    max_restarts: restarts allowed after failures.
    max_preemptions: restarts allowed after preemptions (see above).

  Returns:
    0 on success, else the exit code of the last attempt (`Outcome.exit_code`).
  """
  check_restarts(max_restarts, max_preemptions)
  if max_preemptions is None:
    max_preemptions = DEFAULT_MAX_PREEMPTIONS if max_restarts > 0 else 0
  restarts = preemptions = 0
  while True:
    outcome = attempt(restarts + preemptions)
    if outcome.ok:
      if restarts + preemptions:
        done = [_plural(n, noun) for n, noun in ((restarts, "restart"),
                                                  (preemptions, "preemption restart")) if n]
        note(f"all hosts exited 0 after {' and '.join(done)}.")
      return 0
    note(describe(outcome))
    code = outcome.exit_code()
    if outcome.signal is not None or outcome.timed_out:
      return code
    what = failure(outcome)
    if outcome.preempted:
      if preemptions >= max_preemptions:
        if max_preemptions:
          note(f"giving up after {_plural(preemptions, 'preemption restart')} "
               f"(--max-preemptions {max_preemptions}); last: {what}; exiting {code}.")
        else:
          note(f"exiting {code} (preempted) so that an outer scheduler can requeue the job; "
               "--max-preemptions N restarts it here instead.")
        return code
      preemptions += 1
      note(f"preemption restart {preemptions}/{max_preemptions} after {what}")
    else:
      if restarts >= max_restarts:
        if max_restarts:
          note(f"giving up after {_plural(restarts, 'restart')} (--max-restarts {max_restarts}); "
               f"last failure: {what}; exiting {code}.")
        return code
      restarts += 1
      note(f"restart {restarts}/{max_restarts} after {what}")


def _plural(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def note(message: str) -> None:
  """Prints a `[launcher] ` line to stderr, where the launchers say what they decide."""
  print(f"[launcher] {message}", file=sys.stderr, flush=True)


def failure(outcome: Outcome) -> str:
  """One phrase for what ended the hosts, e.g. `host 1 failed with signal SIGKILL`."""
  n = len(outcome.returncodes)
  if outcome.signal is not None:
    return f"received {_signal_name(outcome.signal)}"
  if outcome.timed_out:
    return "timed out"
  if outcome.failed_host is None:
    return f"all {n} hosts exited 0"
  i = outcome.failed_host
  rc = outcome.returncodes[i] or 0
  if rc == PREEMPTED_EXIT:
    return f"host {i} was preempted (exit code {rc})"
  how = f"exit code {rc}" if rc >= 0 else f"signal {_signal_name(-rc)}"
  return f"host {i} failed with {how}"


def describe(outcome: Outcome) -> str:
  """A human summary of a failed `Outcome`: who failed, how, and the last lines."""
  n = len(outcome.returncodes)
  if outcome.signal is not None or outcome.timed_out:
    return f"{failure(outcome)}; stopped all {n} hosts."
  if outcome.failed_host is None:
    return f"{failure(outcome)}."
  i = outcome.failed_host
  others = {1: "", 2: "; stopped the other host"}.get(n, f"; stopped the other {n - 1} hosts")
  text = f"{failure(outcome)}{others}."
  if outcome.preempted:
    return text  # It saved and asked for a restart: its last lines are no error report.
  lines = outcome.tails[i] if outcome.tails else []
  if lines:
    text += f"\nLast {len(lines)} output lines of host {i}:\n" + "\n".join(
        f"  {line}" for line in lines)
  else:
    text += f"\nhost {i} printed nothing."
  return text


def _peek(proc: subprocess.Popen) -> int | None:
  if proc.returncode is not None:
    return proc.returncode
  try:
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  except ChildProcessError:  # Reaped elsewhere.
    return proc.poll()
  if info is None:
    return None
  return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return str(signum)


def _signal_group(pgid: int, signum: int) -> None:
  try:
    os.killpg(pgid, signum)
  except (ProcessLookupError, PermissionError):
    pass  # The group is already gone.


def _install_handlers(received: list[int]) -> dict[int, object]:
  if threading.current_thread() is not threading.main_thread():
    return {}

  def handler(signum, frame):
    del frame
    received.append(signum)

  previous = {}
  for signum in STOP_SIGNALS:
    previous[signum] = signal.signal(signum, handler)
  return previous


def _restore_handlers(previous: Mapping[int, object]) -> None:
  for signum, old in previous.items():
    signal.signal(signum, old)
