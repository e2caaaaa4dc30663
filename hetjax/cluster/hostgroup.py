"""N host processes as one group: spawn, prefix output, stop trees, record exits.

Each host runs in its own session, so a stop (SIGTERM to the group, a grace,
then SIGKILL to the group) reaches everything it started; a descendant that
calls `setsid` escapes, as nothing portable can follow it. Each starts under
`hostguard`, so no host trains on as an orphan of a SIGKILLed launcher. Who
failed first comes from each process's own exit time, not from poll order:
a dead host's peers die of the broken collective moments later.
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
from hetjax.cluster.service import split_lines, write_line  # noqa: F401 (procs reads split_lines)
from hetjax.cluster.supervise import Findings

# The time a host that takes SIGTERM as a preemption notice gets to react; then SIGKILL.
DEFAULT_GRACE_S = 5.0
TAIL_LINES = 20
# gloo's line per host when the CPU collectives connect: hidden unless HETJAX_SHOW_GLOO=1.
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
POLL_S = 0.05  # How often a waiting loop looks at the hosts.


class HostGroup:
  """N host processes, each in its own process group, output prefixed by host."""

  def __init__(self, commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
               sink: IO[str] | None = None, findings: Findings | None = None):
    """Call `start` from a thread that outlives the hosts: the guard's parent-death signal
    fires when the *thread* that started them ends. `sink` gets the prefixed lines (None: only
    tails); `findings` may be shared with other readers (the coordination service's).
    """
    if len(commands) != len(envs):
      raise ValueError(f"got {len(commands)} commands but {len(envs)} environments.")
    self._commands = [list(c) for c in commands]
    self._envs = [dict(e) for e in envs]
    self._sink = sink
    self._lock = threading.Lock()
    self.procs: list[subprocess.Popen] = []
    self.tails = [collections.deque(maxlen=TAIL_LINES) for _ in commands]
    self._readers: list[threading.Thread] = []
    self._exits = _ExitClock(len(commands))
    self.findings = Findings() if findings is None else findings

  def start(self) -> None:
    """Starts every host, or none: FileNotFoundError when a program is not on its PATH."""
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
    """Copies one host's output, prefixed, and keeps its tail (`\\r` ends a line too)."""
    prefix = f"[host {host}] "
    with pipe:
      for line in split_lines(iter(lambda: pipe.read1(65536), b"")):
        if _GLOO_CONNECTED.match(line) and not os.environ.get(Env.SHOW_GLOO):
          continue
        with self._lock:
          self.tails[host].append(line)
          self.findings.scan(host, line)
          self._sink = write_line(self._sink, prefix + line)

  def exit_times(self, settle_s: float = 1.0) -> list[float | None]:
    """Each host's exit time (None: running), once every exited host's is recorded or
    `settle_s` passed, so that a caller deciding who died first sees them all."""
    return self._exits.settle([i for i, rc in enumerate(self.poll()) if rc is not None], settle_s)

  def forward(self, signum: int) -> None:
    """Sends `signum` to every host's process group, as a terminal's Ctrl-C would."""
    for p in self.procs:
      _signal_group(p.pid, signum)

  def poll(self) -> list[int | None]:
    """Exit codes (None: running), unreaped: the pid, and so the group id, stays reserved until
    `stop`, whose SIGKILL can then never hit a stranger that reused the number."""
    return [_peek(p) for p in self.procs]

  def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGTERM every group, up to `grace_s` for the hosts, then SIGKILL every group, even
    one whose main process exited, so nothing a host started outlives it."""
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
  """When each process exited, in the kernel's order: epoll on pidfds returns them in the order
  they became ready, however late this thread runs (a thread per process, the fallback without
  pidfds, can swap two exits a millisecond apart while it waits for the GIL).
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
