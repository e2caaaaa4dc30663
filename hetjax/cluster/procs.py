"""Running N host processes: spawn, prefix output, stop trees.

Shared by `launch/local.py`, `launch/hosts.py` (whose processes are the ssh
clients) and `hetjax.cluster.testing`, so the launchers that people use and the
harness that tests use stop processes in exactly the same way.
`hetjax.cluster.supervise` reads how a group ended and restarts it after a
failure or a preemption (PREEMPTED_EXIT); its names are re-exported here.

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

import collections
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
from typing import IO, Iterable, Iterator, Mapping, Sequence

from hetjax.config import Env
from hetjax.cluster import emulate
# How a group ended and whether to restart it lives in `supervise`; its public
# names are importable from here too, where the launchers and tests use them.
from hetjax.cluster.supervise import (  # noqa: F401 (public names)
    DEFAULT_MAX_PREEMPTIONS, PREEMPTED_EXIT, STALLED_EXIT, USER_STOP_EXIT, Findings, Outcome,
    _signal_name, add_restart_arguments, check_restarts, describe, failure, first_failure, note,
    supervise)

# A JAX host with the distributed runtime up treats SIGTERM as a preemption
# notice and keeps running, so the grace is the time a trainer that watches
# for preemption gets to react; after it, SIGKILL.
DEFAULT_GRACE_S = 5.0
TAIL_LINES = 20
# gloo (inside jaxlib) prints one such line per host when the CPU collectives
# connect; hidden from the launcher's output and the failure tails unless
# HETJAX_SHOW_GLOO=1.
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
_POLL_S = 0.05
# Signals that make the launcher stop its hosts; it then exits 128 + signum.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What the hosts receive when the launcher gets one of STOP_SIGNALS: a user's
# Ctrl-C stays a Ctrl-C; a hang-up is a stop like SIGTERM.
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
             signal.SIGHUP: signal.SIGTERM}


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
                 host_env: Mapping[int, Mapping[str, str]] | None = None,
                 heartbeat_timeout_s: int | None = None) -> list[dict[str, str]]:
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
    heartbeat_timeout_s: optional seconds without heartbeats before the
      coordination service declares a host dead (HETJAX_HEARTBEAT_TIMEOUT).

  Returns:
    A list of `hosts` complete environments.
  """
  speeds = validate_cluster(hosts, devices_per_host, speeds, init_timeout_s)
  if heartbeat_timeout_s is not None and (not isinstance(heartbeat_timeout_s, int)
                                          or heartbeat_timeout_s < 1):
    raise ValueError(f"the heartbeat timeout (--heartbeat-timeout) must be a whole number of "
                     f"seconds >= 1, got {heartbeat_timeout_s!r}.")
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
    if heartbeat_timeout_s is not None:
      env[Env.HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    if speeds is not None:
      env[Env.SPEED] = repr(speeds[i])
    if slowdown:
      env[Env.SLOWDOWN] = slowdown
    if device_sample_ms is not None:
      env[Env.DEVICE_SAMPLE_MS] = repr(float(device_sample_ms))
    env.update(host_env.get(i, {}))
    envs.append(env)
  return envs


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
    self.findings = Findings()

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
        if _GLOO_CONNECTED.match(line) and not os.environ.get(Env.SHOW_GLOO):
          continue
        with self._lock:
          self.tails[host].append(line)
          self.findings.scan(host, line)
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
  outcome.unresponsive = sorted(group.findings.unresponsive)
  outcome.stalled = sorted(group.findings.stalled)
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
                 host_env: Mapping[int, Mapping[str, str]] | None = None,
                 heartbeat_timeout_s: int | None = None) -> int:
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
               "host_env": host_env, "heartbeat_timeout_s": heartbeat_timeout_s}
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
