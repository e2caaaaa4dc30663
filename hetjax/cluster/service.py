"""JAX's coordination service in a process of its own, beside the hosts rather than inside host 0.

Inside host 0 (JAX's way), its death takes the service along and JAX aborts
every other host before Python can say a word. So a launcher runs it each
attempt (`Service`; the SLURM scripts; `launch/hosts.py --service-python`
via `remote_argv`) and sets HETJAX_SERVICE=launcher: host 0 is a client and
its death one line on each survivor (`lost_peer`). Without jaxlib in the
launcher's Python, or on Kubernetes, host 0 keeps it. Stdlib at import, no
hetjax import: the service process runs `-I` and imports only jaxlib.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Iterable, Iterator, Sequence

ELSEWHERE = "launcher"  # HETJAX_SERVICE's value: host 0 joins as a client only.
READY = "[hetjax] coordination service listening on"
READY_WAIT_S = 120.0  # The service imports jaxlib before it listens.
PREFIX = "[service] "
# JAX's own settings for the service it would start in process 0.
SHUTDOWN_TIMEOUT_S = 300
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostguard.py")


# Runs the installed hetjax's copy of this file without importing hetjax
# (which would import JAX): `python -I -c _BOOT ADDRESS NUM_HOSTS HEARTBEAT_S`.
_BOOT = ("import importlib.util as u, os, runpy, sys; s = u.find_spec('hetjax'); "
         "s or sys.exit('hetjax is not installed in ' + sys.executable); "
         "runpy.run_path(os.path.join(s.submodule_search_locations[0], 'cluster', 'service.py'), "
         "run_name='__main__')")


def remote_argv(python: str, address: str, num_hosts: int, heartbeat_s: int) -> list[str]:
  """The command that runs the service with `python` (one with hetjax and jaxlib) elsewhere.

  Example:
    >>> remote_argv(".venv/bin/python", "node-a:29517", 3, 100)[:3]
    ['.venv/bin/python', '-I', '-c']
  """
  return [python, "-I", "-c", _BOOT, address, str(num_hosts), str(heartbeat_s)]


class Service:
  """The coordination service process of one attempt, seen from the (stdlib-only) launcher."""

  def __init__(self, address: str, num_hosts: int, heartbeat_s: int,
               sink: IO[str] | None, scan: Callable[[str], None],
               command: Sequence[str] | None = None):
    """`scan` reads each log line (the launcher's `Findings`), `sink` gets them prefixed;
    `command` runs the service elsewhere (ssh, then `remote_argv`); None: here, guarded."""
    self._argv = [address, str(num_hosts), str(heartbeat_s)]
    self._command = None if command is None else list(command)
    self._sink, self._scan = sink, scan
    self._ready = threading.Event()
    self._lock = threading.Lock()
    self.proc: subprocess.Popen | None = None
    self._reader: threading.Thread | None = None

  def start(self) -> str | None:
    """Starts the service and waits until it listens; None then, else why host 0 keeps it."""
    command = self._command
    if command is None:
      if importlib.util.find_spec("jaxlib") is None:
        return f"the launcher's Python ({sys.executable}) has no jaxlib"
      # -I: neither this folder nor PYTHONPATH shadows what jaxlib imports.
      command = [sys.executable, "-I", _GUARD, str(os.getpid()), "--",
                 sys.executable, "-I", os.path.abspath(__file__), *self._argv]
    self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    self._reader = threading.Thread(target=self._pump, name="hetjax-service-output", daemon=True)
    self._reader.start()
    # Polled, not only waited: a service that fails to start never prints READY.
    deadline = time.monotonic() + READY_WAIT_S
    while not self._ready.wait(0.05):
      if self.proc.poll() is not None or not self._reader.is_alive():
        self.stop()
        return f"the service process ended with code {self.proc.returncode} before listening"
      if time.monotonic() > deadline:
        self.stop()
        return f"the service did not listen within {READY_WAIT_S:g} s"
    return None

  def _pump(self) -> None:
    assert self.proc is not None and self.proc.stdout is not None
    with self.proc.stdout as pipe:
      for line in split_lines(iter(lambda: pipe.read1(65536), b"")):
        if line.startswith(READY):
          self._ready.set()
          continue
        with self._lock:
          self._scan(line)
          self._sink = write_line(self._sink, PREFIX + line)

  def stop(self) -> None:
    """Ends the service (after the hosts: a host whose service vanishes is aborted)."""
    if self.proc is None:
      return
    for signum in (signal.SIGTERM, signal.SIGKILL):
      try:
        os.killpg(self.proc.pid, signum)
      except (ProcessLookupError, PermissionError):
        break
      try:
        self.proc.wait(timeout=5.0)
        break
      except subprocess.TimeoutExpired:
        continue
    self.proc.wait()
    if self._reader is not None:
      self._reader.join(5.0)


def client():
  """This host's key-value client; None before joining. JAX offers no public handle (orbax and
  `multihost_utils` read it the same way): BUILD_NOTES."""
  from jax._src import distributed  # The one handle on the key-value store: BUILD_NOTES.
  return distributed.global_state.client


def _serve(address: str, num_hosts: int, heartbeat_s: int) -> int:
  """Listens until SIGTERM / SIGINT / SIGHUP or the launcher's death. One ignored from the start
  stays ignored: the SLURM script ignores scancel's, as the hosts still need it to save."""
  stops = {s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
           if signal.getsignal(s) != signal.SIG_IGN}
  signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # Before the service's threads exist.
  # Warnings and errors only (which name the dead hosts), as in a host: no log of every barrier.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  from jaxlib import _jax  # The service alone: no JAX, no backend.
  host = address.rsplit(":", 1)[0].strip("[]")
  loopback = host in ("127.0.0.1", "localhost", "::1")
  # Bound as JAX binds it: every interface, unless the hosts are all on this machine.
  bind = address if loopback else "[::]:" + address.rsplit(":", 1)[1]
  service = _jax.get_distributed_runtime_service(
      bind, num_hosts, heartbeat_timeout=heartbeat_s, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
  print(f"{READY} {address}", flush=True)
  signal.sigwait(stops)
  # Left without the service's shutdown, which would wait for hosts that are gone.
  sys.stdout.flush()
  os._exit(0)


def split_lines(chunks: Iterable[bytes]) -> Iterator[str]:
  """Decoded lines ending in `\\n`, `\\r\\n` or a lone `\\r` (empty redraw pieces dropped)."""
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


def write_line(sink: IO[str] | None, line: str) -> IO[str] | None:
  """Writes `line` to `sink`; None once the sink is closed or broken (keep draining the host)."""
  if sink is not None:
    try:
      sink.write(line + "\n")
      sink.flush()
    except (OSError, ValueError):
      return None
  return sink


_LINE_END = re.compile(rb"\r*\n|\r+")


if __name__ == "__main__":
  if len(sys.argv) != 4:
    print("usage: python -I hetjax/cluster/service.py ADDRESS NUM_HOSTS HEARTBEAT_S",
          file=sys.stderr)
    sys.exit(2)
  sys.exit(_serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))

