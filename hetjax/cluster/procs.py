"""Running N host processes: spawn, prefix output, stop trees, restart.

Shared by `launch/local.py`, `launch/hosts.py` (whose processes are the ssh
clients) and `hetjax.cluster.testing`, so the launchers that people use and the
harness that tests use stop processes in exactly the same way. `supervise`
restarts a whole group after a failure or a preemption (PREEMPTED_EXIT).

Every host runs in its own session (and so its own process group), which
lets us signal the host together with everything it started. Stopping is
SIGTERM to the group, a grace period for the host's main process to exit,
then SIGKILL to the group, so descendants that ignore SIGTERM die too. A
descendant that leaves the group on purpose (`setsid`) escapes; nothing
stdlib-only and portable can follow it.

Every host starts under `hetjax.cluster.hostguard`, which kills the host's group when
the launcher dies, even by SIGKILL, so no host trains on as an orphan.

A launcher that is told to stop passes the signal on: Ctrl-C (SIGINT) reaches
every host as SIGINT (a user's stop: a hetjax host saves and exits 130),
SIGTERM and SIGHUP as SIGTERM (a preemption: it saves and exits 75). A second
signal kills the hosts at once.

Who failed first is decided from each process's own exit time, recorded by a
thread that waits on it, not from the order a poll happens to find them in:
when one host dies, its peers die of the broken collective moments later.

Stdlib only: this module must never import JAX.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Iterable, Iterator, Mapping, Sequence

from hetjax.config import Env
from hetjax.cluster import emulate

# Mirrors hetjax.cluster.runtime, which cannot be imported here without JAX.
# How many times a launcher restarted the job before this attempt (for logs).

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
# What the hosts receive when the launcher gets one of STOP_SIGNALS: a user's
# Ctrl-C stays a Ctrl-C; a hang-up is a stop like SIGTERM.
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
             signal.SIGHUP: signal.SIGTERM}
# A host that exits with this code (or dies by SIGINT) was stopped by a user's
# Ctrl-C: reported as a stop, never restarted.
USER_STOP_EXIT = 128 + signal.SIGINT


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
                 device_sample_ms: float | None = None,
                 host_env: Mapping[int, Mapping[str, str]] | None = None) -> list[dict[str, str]]:
  """One environment per host, as `hetjax.cluster.runtime.initialize()` reads it.

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
    host_env: optional per-host variables, {host: {key: value}}, e.g. another
      XLA_FLAGS on one host to emulate hosts that compile differently
      (`emulate.parse_host_env`).

  Returns:
    A list of `hosts` complete environments.
  """
  speeds = validate_cluster(hosts, devices_per_host, speeds, init_timeout_s)
  if device_sample_ms is not None:
    emulate.sample_ms_from_env({Env.DEVICE_SAMPLE_MS: str(device_sample_ms)})
  for s in emulate.parse_slowdowns(slowdown or ""):
    if s.host >= hosts:
      raise ValueError(f"--slowdown names host {s.host} but there are {hosts} hosts (0..{hosts - 1}).")
  host_env = dict(host_env or {})
  if any(not 0 <= h < hosts for h in host_env):
    raise ValueError(f"host_env names host(s) {sorted(host_env)} but there are {hosts} hosts.")
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  envs = []
  for i in range(hosts):
    env = dict(os.environ if base is None else base)
    env.update({Env.COORDINATOR: coordinator, Env.NUM_HOSTS: str(hosts), Env.HOST_ID: str(i),
                Env.CPU_DEVICES: str(devices_per_host), "PYTHONUNBUFFERED": "1"})
    if init_timeout_s is not None:
      env[Env.INIT_TIMEOUT] = f"{init_timeout_s:g}"
    if speeds is not None:
      env[Env.SPEED] = repr(speeds[i])
    if slowdown:
      env[Env.SLOWDOWN] = slowdown
    if device_sample_ms is not None:
      env[Env.DEVICE_SAMPLE_MS] = repr(float(device_sample_ms))
    env.update(host_env.get(i, {}))
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
  def stopped_by_user(self) -> bool:
    """Whether a user's Ctrl-C ended the hosts (to the launcher or to a host)."""
    if self.signal is not None:
      return self.signal == signal.SIGINT
    return (not self.timed_out and self.failed_host is not None
            and self.returncodes[self.failed_host] in (USER_STOP_EXIT, -signal.SIGINT))

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
               cwd: str | None = None, guard: bool = True):
    """Args:
      commands: the argv of each host.
      envs: the environment of each host.
      sink: where prefixed output lines go (None: only kept as tails).
      tail_lines: how many last output lines to keep per host.
      cwd: the hosts' working folder (default: ours).
      guard: start each host under `hetjax.cluster.hostguard`, so it dies with this
        process. Its parent-death signal fires when the *thread* that called
        `start` ends: call `start` from a thread that outlives the hosts.
    """
    if len(commands) != len(envs):
      raise ValueError(f"got {len(commands)} commands but {len(envs)} environments.")
    self._commands = [list(c) for c in commands]
    self._envs = [dict(e) for e in envs]
    self._sink = sink
    self._cwd = cwd
    self._guard = guard
    self._lock = threading.Lock()
    self.procs: list[subprocess.Popen] = []
    self.tails = [collections.deque(maxlen=tail_lines) for _ in commands]
    self._readers: list[threading.Thread] = []
    self._exits = _ExitClock(len(commands))

  def start(self) -> None:
    """Starts every host; if one cannot start, stops those already running.

    Raises:
      FileNotFoundError: a host's program is not on its PATH (nothing started).
    """
    for cmd, env in zip(self._commands, self._envs):
      program = cmd[0] if cmd else ""
      if self._cwd and os.sep in program:  # A relative path names a file in the hosts' folder.
        program = os.path.join(self._cwd, program)
      if not program or shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        self._exits.close()
        raise FileNotFoundError(f"no such program: {cmd[0] if cmd else '(empty command)'!r}")
    try:
      for i, (cmd, env) in enumerate(zip(self._commands, self._envs)):
        if self._guard:  # -I: the guard needs nothing but the standard library.
          cmd = [sys.executable, "-I", _GUARD, str(os.getpid()), "--", *cmd]
        proc = subprocess.Popen(cmd, env=env, cwd=self._cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        self._exits.watch(i, proc.pid)
        reader = threading.Thread(target=self._pump, args=(i, proc.stdout),
                                  name=f"hetjax-host-{i}-output", daemon=True)
        reader.start()
        self._readers.append(reader)
    except BaseException:
      self.stop(grace_s=0.0)
      raise

  def _pump(self, host: int, pipe: IO[bytes]) -> None:
    """Copies one host's output, line by line, prefixed, and keeps its tail.

    A carriage return ends a line too, so a progress line that redraws itself
    with `\\r` shows up at every redraw instead of never.
    """
    prefix = f"[host {host}] "
    with pipe:
      for line in split_lines(iter(lambda: pipe.read1(65536), b"")):
        with self._lock:
          self.tails[host].append(line)
          if self._sink is not None:
            try:
              self._sink.write(prefix + line + "\n")
              self._sink.flush()
            except (OSError, ValueError):  # Closed or broken sink: keep draining the host.
              self._sink = None

  def exit_times(self, settle_s: float = 1.0) -> list[float | None]:
    """Each host's own exit time (monotonic seconds, in the order the kernel saw the exits).

    None while running. Waits up to `settle_s` for every host that has exited
    to be recorded, so that a caller deciding who died first sees them all.
    """
    return self._exits.settle([i for i, rc in enumerate(self.poll()) if rc is not None], settle_s)

  def forward(self, signum: int) -> None:
    """Sends `signum` to every host's process group, as a terminal's Ctrl-C would."""
    for p in self.procs:
      _signal_group(p.pid, signum)

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
    self._exits.close()

  def join_output(self, timeout_s: float = 5.0) -> None:
    """Waits for the output of stopped hosts to drain (bounded: escapees hold pipes)."""
    deadline = time.monotonic() + timeout_s
    for reader in self._readers:
      reader.join(max(0.0, deadline - time.monotonic()))

  def tail(self, host: int) -> list[str]:
    with self._lock:
      return list(self.tails[host])


class _ExitClock:
  """When each process exited, in the order the kernel saw the exits.

  One thread waits on the processes' pidfds with epoll, which hands ready
  descriptors back in the order they became ready: two hosts that die a
  millisecond apart are told apart however late this thread gets to run (a
  thread per process, stamping the time when it wakes, can swap them while it
  waits for the GIL). Without pidfds (not Linux), one such thread per process.
  """

  def __init__(self, n: int):
    self._times: list[float | None] = [None] * n
    self._last = -math.inf
    self._lock = threading.Lock()
    self._fds: dict[int, int] = {}
    self._epoll = None
    if hasattr(os, "pidfd_open") and hasattr(select, "epoll"):
      self._epoll = select.epoll()
      self._wake_r, self._wake_w = os.pipe()
      self._epoll.register(self._wake_r, select.EPOLLIN)
      self._thread = threading.Thread(target=self._run, name="hetjax-host-exits", daemon=True)
      self._thread.start()

  def watch(self, host: int, pid: int) -> None:
    """Starts watching the (unreaped) child `pid`, host `host`."""
    if self._epoll is not None:
      try:
        fd = os.pidfd_open(pid)
      except OSError:
        fd = None
      if fd is not None:
        with self._lock:
          self._fds[fd] = host
        self._epoll.register(fd, select.EPOLLIN)
        return
    threading.Thread(target=self._wait_one, args=(host, pid), daemon=True,
                     name=f"hetjax-host-{host}-exit").start()

  def _record(self, host: int) -> None:
    with self._lock:  # Strictly increasing, so that the order survives equal clock readings.
      self._last = max(time.monotonic(), self._last + 1e-6)
      self._times[host] = self._last

  def _run(self) -> None:
    while True:
      for fd, _ in self._epoll.poll():
        if fd == self._wake_r:
          return
        with self._lock:
          host = self._fds.pop(fd)
        self._epoll.unregister(fd)
        os.close(fd)
        self._record(host)

  def _wait_one(self, host: int, pid: int) -> None:
    try:
      os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # Reaped by `stop` before this thread ran.
      pass
    self._record(host)

  def settle(self, hosts: Sequence[int], timeout_s: float) -> list[float | None]:
    """The times, once those of `hosts` are recorded (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while any(self._times[h] is None for h in hosts) and time.monotonic() < deadline:
      time.sleep(0.001)
    with self._lock:
      return list(self._times)

  def close(self) -> None:
    """Stops the watching thread and closes its descriptors (the processes are reaped)."""
    if self._epoll is None or self._epoll.closed:
      return
    os.write(self._wake_w, b"x")
    self._thread.join()
    for fd in list(self._fds):
      os.close(fd)
    for fd in (self._wake_r, self._wake_w):
      os.close(fd)
    self._epoll.close()


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
      if received:
        outcome.signal = received[0]
      elif any(rc not in (None, 0) for rc in codes):
        outcome.failed_host = first_failure(group.poll(), group.exit_times())
      elif all(rc == 0 for rc in codes):
        break
      elif deadline is not None and time.monotonic() > deadline:
        outcome.timed_out = True
      if not outcome.ok:
        break
      time.sleep(_POLL_S)
    if outcome.signal is not None:
      _pass_on(group, received, grace_s)
  finally:
    # Runs on success too: it kills whatever the hosts left behind.
    group.stop(grace_s if outcome.signal is None else 0.0)
    group.join_output()
    _restore_handlers(previous)
  outcome.returncodes = group.poll()
  outcome.tails = [group.tail(i) for i in range(len(commands))]
  return outcome


def _pass_on(group: HostGroup, received: list[int], grace_s: float) -> None:
  """Forwards the launcher's stop signal to the hosts and waits for them to end.

  A user's Ctrl-C waits as long as the hosts take to save (a hetjax host stops
  at the next step boundary); SIGTERM / SIGHUP wait `grace_s`. Once one host
  has ended, the others get `grace_s` more (a host stuck in a collective with
  a peer that is gone never ends by itself). A second signal ends the wait.
  """
  first = received[0]
  group.forward(FORWARDED.get(first, first))
  note(f"received {_signal_name(first)}: passed {_signal_name(FORWARDED.get(first, first))} on "
       f"to the hosts and waiting for them to stop" + (" (Ctrl-C again to kill them now)"
                                                     if first == signal.SIGINT else ""))
  seen = len(received)
  limit = None if first == signal.SIGINT else time.monotonic() + grace_s
  while len(received) == seen:
    codes = group.poll()
    if all(rc is not None for rc in codes):
      return
    now = time.monotonic()
    if any(rc is not None for rc in codes):
      limit = min(limit or math.inf, now + grace_s)
    if limit is not None and now > limit:
      return
    time.sleep(_POLL_S)


def first_failure(codes: Sequence[int | None],
                  exit_times: Sequence[float | None] | None = None) -> int | None:
  """The host to blame among those that exited non-zero by themselves, if any.

  When a host dies, its peers fail soon after in the collective they shared,
  so the cause is ranked first:
  1. a host killed by a signal from outside (SIGKILL, the OOM killer, a
     crash), never a reaction to a peer; SIGABRT does not count, it is how
     JAX ends a process whose peer vanished;
  2. then the earliest to exit, by each process's own exit time;
  3. at equal times, a real failure before a preemption: restarting a crash
     as "preempted" would hide it from --max-restarts; then the lowest index.

  Args:
    codes: per host, its exit code (negative: the signal), None if running.
    exit_times: per host, when it exited (any clock); None: all equal.
  """
  failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
  if not failed:
    return None

  def rank(i: int) -> tuple:
    rc = codes[i]
    t = exit_times[i] if exit_times is not None and exit_times[i] is not None else math.inf
    killed = rc < 0 and -rc != signal.SIGABRT
    return (not killed, t if exit_times is not None else 0.0, rc == PREEMPTED_EXIT, i)

  return min(failed, key=rank)


def split_lines(chunks: Iterable[bytes]) -> Iterator[str]:
  """Decoded lines from a byte stream whose lines end in `\\n`, `\\r\\n` or a lone `\\r`.

  An unfinished last line is yielded at the end; the empty pieces between
  consecutive carriage returns (a redraw) are dropped.
  """
  pending = b""
  for chunk in chunks:
    pending += chunk
    # A trailing \r may be the first half of \r\n: keep it for the next chunk.
    cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
    start = 0
    for end in _LINE_END.finditer(pending, 0, cut):
      piece = pending[start:end.start()]
      if piece or b"\n" in end.group():
        yield piece.decode("utf-8", errors="replace")
      start = end.end()
    pending = pending[start:]
  pending = pending.rstrip(b"\r")
  if pending:
    yield pending.decode("utf-8", errors="replace")


_LINE_END = re.compile(rb"\r*\n|\r+")
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostguard.py")


def launch_local(command: Sequence[str], *, hosts: int, devices_per_host: int = 1,
                 speeds: Sequence[float] | None = None, init_timeout_s: float | None = None,
                 grace_s: float = DEFAULT_GRACE_S, sink: IO[str] | None = None,
                 slowdown: str | None = None, max_restarts: int = 0,
                 max_preemptions: int | None = None,
                 device_sample_ms: float | None = None,
                 host_env: Mapping[int, Mapping[str, str]] | None = None) -> int:
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
  emulation = {"speeds": speeds, "slowdown": slowdown, "device_sample_ms": device_sample_ms,
               "host_env": host_env}
  cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s,
               **emulation)  # Validates everything before the first start.

  def attempt(restart_count: int) -> Outcome:
    envs = cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s, **emulation)
    for env in envs:
      env[Env.RESTART_COUNT] = str(restart_count)
    note(f"{hosts} host(s) x {devices_per_host} device(s), coordinator "
         f"{envs[0][Env.COORDINATOR]}: {' '.join(command)}")
    for host, extra in sorted((host_env or {}).items()):
      note(f"emulated: host {host} runs with " + " ".join(f"{k}={v}" for k, v in extra.items()))
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
    if outcome.signal is not None or outcome.timed_out or outcome.stopped_by_user:
      return code  # A user's stop, our own stop or a deadline: never restarted.
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
  if outcome.signal == signal.SIGINT:
    return "stopped by the user (Ctrl-C, SIGINT)"
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
  if outcome.stopped_by_user:
    return f"host {i} was stopped by the user ({'exit code' if rc > 0 else 'signal'} " \
           f"{rc if rc > 0 else _signal_name(-rc)})"
  how = f"exit code {rc}" if rc >= 0 else f"signal {_signal_name(-rc)}"
  return f"host {i} failed with {how}"


def describe(outcome: Outcome) -> str:
  """A human summary of a failed `Outcome`: who failed, how, and the last lines."""
  n = len(outcome.returncodes)
  if outcome.signal is not None:
    ends = ", ".join(f"host {i} {_end(rc)}" for i, rc in enumerate(outcome.returncodes))
    return f"{failure(outcome)}; all {n} hosts stopped ({ends})."
  if outcome.timed_out:
    return f"{failure(outcome)}; stopped all {n} hosts."
  if outcome.failed_host is None:
    return f"{failure(outcome)}."
  i = outcome.failed_host
  others = {1: "", 2: "; stopped the other host"}.get(n, f"; stopped the other {n - 1} hosts")
  text = f"{failure(outcome)}{others}."
  if outcome.preempted or outcome.stopped_by_user:
    return text  # It saved and asked for a restart: its last lines are no error report.
  lines = outcome.tails[i] if outcome.tails else []
  if lines:
    text += f"\nLast {len(lines)} output lines of host {i}:\n" + "\n".join(
        f"  {line}" for line in lines)
  else:
    text += f"\nhost {i} printed nothing."
  return text


def _end(rc: int | None) -> str:
  if rc is None:
    return "still running"
  return f"exit code {rc}" if rc >= 0 else f"signal {_signal_name(-rc)}"


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
