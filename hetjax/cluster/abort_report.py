"""A host that JAX aborts says so in one line; the C++ report goes to OUT/host<i>-error.log.

JAX's C++ fatal error (SIGABRT, when the service is gone or declares a peer
dead) is ~30 lines Python never sees. So a multi-host host's stderr passes
through a relay (`start`) that copies it, except from JAX's fatal line on:
that report, the native lines held HOLD_S before it and every thread's
Python stack go to the file, and the host says one line, as `lost_peer`
does. Stdlib only, no hetjax import (it runs `-I`).
"""

from __future__ import annotations

import faulthandler
import os
import re
import select
import signal
import subprocess
import sys
import time

HOLD_S = 0.5
_NATIVE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\] ")
_FATAL = re.compile(rb"^(F\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\] |Fatal Python error: |"
                    rb"\*\*\* (Check failure stack trace|SIG[A-Z]+ received))")
_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|INTERNAL|ABORTED|CANCELLED|"
                     r"FAILED_PRECONDITION): ?([^\n]*)")
_LINE = re.compile(rb"[^\r\n]*(?:\r?\n|\r)")
# The coordination service's list of dead hosts, which the launchers read (`supervise`).
_TASK = re.compile(rb"^\s*(?:/job:\S+task:)?\d+\s*$")
_RELAY: list[subprocess.Popen] = []


def start(log_dir: str, host_id: int) -> None:
  """Routes stderr (and the Python stacks, on a fatal signal) through the relay, once the host
  knows its folder; a terminal's (the progress line redraws) or a failed relay's stays as it is."""
  if _RELAY or not log_dir or os.isatty(2):
    return
  path = os.path.join(os.path.abspath(log_dir), f"host{host_id}-error.log")
  read, write = os.pipe()
  try:  # Its own session: the launcher's stop reaches the host, and the relay ends at its EOF.
    _RELAY.append(subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), path],
                                   stdin=read, stdout=2, start_new_session=True))
  except OSError:
    os.close(write)
    return
  finally:
    os.close(read)
  sys.stderr.flush()
  os.dup2(write, 2)
  os.close(write)
  faulthandler.enable(all_threads=True)


def summary(report: bytes, path: str) -> str:
  """The host's one line for a fatal `report` kept in `path`."""
  text = report.decode(errors="replace")
  fatal = next((line.split("] ", 1)[1] for line in text.splitlines()
                if _FATAL.match(line.encode()) and "] " in line), text.splitlines()[0])
  status = _STATUS.search(text)
  detail = f" ({status.group(0).split('. ')[0].strip()[:120]})" if status else ""
  if status and status.group(1) == "UNAVAILABLE" and "CoordinationService" in text:
    why = f"the coordination service is gone{detail}"
  else:
    why = fatal.split(". ")[0].rstrip(".")[:200] + detail
  return (f"hetjax: error: JAX ended this host: {why}; full report in {path}. Under "
          "--max-restarts the launcher restarts the job from its last checkpoint.\n")


def _relay(path: str) -> None:
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, signal.SIG_IGN)  # It ends when the host's stderr closes.
  pending: list[bytes] = []  # Held since `held`: a native line and what came after it.
  report: list[bytes] | None = None
  held, rest, out = None, b"", sys.stdout.buffer
  while True:
    wait = None if held is None and not rest else 0.05
    chunk = os.read(0, 65536) if select.select([0], [], [], wait)[0] else None
    if chunk is not None:
      rest += chunk
    lines = _LINE.findall(rest)
    rest = rest[sum(map(len, lines)):]
    if not chunk and rest:  # EOF, or a quiet moment: an unfinished line is a line.
      lines, rest = lines + [rest], b""
    for line in lines:
      if report is not None:
        report.append(line)
      elif _FATAL.match(line):
        report, pending, held = pending + [line], [], None
      elif held is not None or _NATIVE.match(line):
        pending.append(line)
        held = held or time.monotonic()
      else:
        out.write(line)
    if held is not None and (time.monotonic() - held > HOLD_S or chunk == b""):
      out.write(b"".join(pending))
      pending, held = [], None
    out.flush()
    if chunk == b"":
      break
  if report is not None:
    out.write(b"".join(_dead_hosts(report)))
    text = b"".join(report)
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(text)
    except OSError as e:
      path = f"nowhere ({e})"
    out.write(summary(text, path).encode())
    out.flush()


def _dead_hosts(report: list[bytes]) -> list[bytes]:
  """The lines that list the hosts the service declared dead, passed on for the launcher."""
  kept, listing = [], False
  for line in report:
    listing = (b"stopped sending heartbeats" in line and line.rstrip().endswith(b":")
               or listing and bool(_TASK.match(line)))
    if listing:
      kept.append(line)
  return kept


if __name__ == "__main__":
  _relay(sys.argv[1])
