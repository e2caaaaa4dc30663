"""N host processes as one group: spawn, prefix output, stop trees, record exits.

Every host runs in its own session (and so its own process group), which
lets us signal the host together with everything it started. Stopping is
SIGTERM to the group, a grace period for the host's main process to exit,
then SIGKILL to the group, so descendants that ignore SIGTERM die too. A
descendant that leaves the group on purpose (`setsid`) escapes; nothing
stdlib-only and portable can follow it.

Every host starts under `hetjax.cluster.hostguard`, which kills the host's group when
the launcher dies, even by SIGKILL, so no host trains on as an orphan.

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
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from hetjax.config import Env
from hetjax.cluster.service import split_lines  # noqa: F401 (procs reads it here too)
from hetjax.cluster.supervise import Findings

# A JAX host with the distributed runtime up treats SIGTERM as a preemption
# notice and keeps running, so the grace is the time a trainer that watches
# for preemption gets to react; after it, SIGKILL.
DEFAULT_GRACE_S = 5.0
TAIL_LINES = 20
# gloo (inside jaxlib) prints one such line per host when the CPU collectives
# connect; hidden from the launcher's output and the failure tails unless
# HETJAX_SHOW_GLOO=1.
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
POLL_S = 0.05  # How often a waiting loop looks at the hosts.


class HostGroup:
  """N host processes, each in its own process group, output prefixed by host."""

  def __init__(self, commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
               sink: IO[str] | None = None, tail_lines: int = TAIL_LINES,
               findings: Findings | None = None):
    """Args:
      commands: the argv of each host; each starts under `hetjax.cluster.hostguard`, so it
        dies with this process. Its parent-death signal fires when the *thread* that called
        `start` ends: call `start` from a thread that outlives the hosts.
      envs: the environment of each host.
      sink: where prefixed output lines go (None: only kept as tails).
      tail_lines: how many last output lines to keep per host.
      findings: what the hosts' lines tell (shared with other readers, such as
        the coordination service's; default: the group's own).
    """
    if len(commands) != len(envs):
      raise ValueError(f"got {len(commands)} commands but {len(envs)} environments.")
    self._commands = [list(c) for c in commands]
    self._envs = [dict(e) for e in envs]
    self._sink = sink
    self._lock = threading.Lock()
    self.procs: list[subprocess.Popen] = []
    self.tails = [collections.deque(maxlen=tail_lines) for _ in commands]
    self._readers: list[threading.Thread] = []
    self._exits = _ExitClock(len(commands))
    self.findings = Findings() if findings is None else findings

  def start(self) -> None:
    """Starts every host; if one cannot start, stops those already running.

    Raises:
      FileNotFoundError: a host's program is not on its PATH (nothing started).
    """
    for cmd, env in zip(self._commands, self._envs):
      program = cmd[0] if cmd else ""
      if not program or shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        self._exits.close()
        raise FileNotFoundError(f"no such program: {cmd[0] if cmd else '(empty command)'!r}")
    try:
      for i, (cmd, env) in enumerate(zip(self._commands, self._envs)):
        # -I: the guard needs nothing but the standard library.
        cmd = [sys.executable, "-I", _GUARD, str(os.getpid()), "--", *cmd]
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
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
      time.sleep(POLL_S)
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


_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostguard.py")


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
