"""`python -I hetjax/cluster/hostguard.py LAUNCHER_PID -- COMMAND ...`: the host, and all it
starts, die with the launcher, even a SIGKILLed one.

It leaves a watcher (handed to init, so no "any child" wait of the host meets
it; deaf to the group's stop signals) that SIGKILLs the group once the
launcher ends, arms `PR_SET_PDEATHSIG`, then execs the command, so the
launcher sees the host's own exit code and time. Stdlib only, quick to start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5


def _launcher_gone(launcher_pid: int) -> bool:
  try:
    os.kill(launcher_pid, 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False
  return False


def _watch(launcher_pid: int, pidfd: int | None) -> None:
  """The watcher's life: wait for the launcher to end, then kill the whole group."""
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)  # Meant for the host; SIGKILL still ends us.
  null = os.open(os.devnull, os.O_RDWR)
  for fd in (0, 1, 2):  # Never hold the host's output pipe open.
    os.dup2(null, fd)
  try:
    if pidfd is not None:
      select.select([pidfd], [], [])  # Readable once the launcher has exited.
    else:
      while not _launcher_gone(launcher_pid):
        time.sleep(_POLL_S)
  finally:
    os.killpg(0, signal.SIGKILL)


def _leave_watcher(launcher_pid: int) -> None:
  """Forks the watcher as a grandchild (the middle process exits at once)."""
  pidfd = None
  if hasattr(os, "pidfd_open"):
    try:
      pidfd = os.pidfd_open(launcher_pid)
    except OSError:
      pidfd = None
  middle = os.fork()
  if middle == 0:
    if os.fork() == 0:
      try:
        _watch(launcher_pid, pidfd)
      finally:
        os._exit(0)
    os._exit(0)
  os.waitpid(middle, 0)
  if pidfd is not None:
    os.close(pidfd)


def _die_with_parent() -> None:
  if sys.platform.startswith("linux"):
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def main(argv: list[str]) -> int:
  if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
    print("usage: python -I hetjax/cluster/hostguard.py LAUNCHER_PID -- COMMAND ...", file=sys.stderr)
    return 2
  launcher_pid, command = int(argv[0]), argv[2:]
  if os.getppid() != launcher_pid:
    return 128 + signal.SIGKILL  # The launcher is already gone: start nothing.
  _leave_watcher(launcher_pid)
  _die_with_parent()
  if os.getppid() != launcher_pid:  # It died before the signal was armed.
    os.killpg(0, signal.SIGKILL)
  try:
    os.execvp(command[0], command)
  except OSError as e:
    print(f"[hetjax] cannot start the host command {command[0]!r}: {e}", file=sys.stderr, flush=True)
    return 127 if isinstance(e, FileNotFoundError) else 126


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
