"""A `launch/local.py ... hetjax train` job driven from a test: read its output, signal its hosts.

The tests wait on what the job prints (a step number, a resume line), never
on the clock, so they do not depend on the machine's load: every wait has a
generous deadline that only a broken job reaches.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from _warm_client import module_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 300.0  # Only a broken job waits this long.


def train_command(out, *extra: str, mode: str = "sync", warm: bool = True) -> list[str]:
  """A tiny, endless `hetjax train` (mlp on digits); the tests stop it.

  `warm`: each host forked from the suite's warm server (`module_command`);
  a test that freezes a host with SIGSTOP needs `warm=False` (a stopped
  client does not stop the host it stands for).
  """
  rounds = [] if mode == "sync" else ["--mode", mode, "--local-steps", "2,2"]
  start = module_command("hetjax.cli") if warm else [sys.executable, "-m", "hetjax.cli"]
  return [*start, "train", "--model", "mlp", "--dataset", "digits",
          "--global-batch", "32", "--microbatch", "4", "--steps", "100000", "--log-every", "1",
          "--out", str(out), *rounds, *extra]


class Job:
  """One launcher process with 2 hosts; its output lines, as they come."""

  def __init__(self, launcher_args: list[str], command: list[str], env: dict | None = None):
    self.lines: list[str] = []
    self._seen = threading.Condition()
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--hosts", "2",
         *launcher_args, "--", *command], cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      with self._seen:
        self.lines.append(line.rstrip("\n"))
        self._seen.notify_all()
    with self._seen:
      self._seen.notify_all()

  def wait_for(self, pattern: str, start: int = 0, check=lambda m: True) -> tuple[re.Match, int]:
    """The first line from `start` on that matches `pattern` (and `check`); its index."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + DEADLINE_S
    i = start
    with self._seen:
      while True:
        while i < len(self.lines):
          found = regex.search(self.lines[i])
          if found and check(found):
            return found, i
          i += 1
        if self.proc.poll() is not None and i >= len(self.lines):
          self._seen.wait(0.5)  # The reader may still be draining the pipe.
          if i >= len(self.lines):
            raise AssertionError(f"the job ended (exit {self.proc.returncode}) before printing "
                                 f"{pattern!r}:\n" + "\n".join(self.lines[-60:]))
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + "\n".join(self.lines[-60:])
        self._seen.wait(1.0)

  def wait_for_step(self, at_least: int, start: int = 0) -> int:
    """Index of host 0's first progress line at or past step `at_least` from `start` on."""
    return self.wait_for(r"\[host 0\] (?:step|round)\s+(\d+)/", start,
                         lambda m: int(m.group(1)) >= at_least)[1]

  def _children(self) -> list[int]:
    pid = self.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return [int(c) for c in f.read().split()]

  def service_pid(self) -> int:
    """The coordination service that the launcher runs beside the hosts of this attempt."""
    for child in self._children():
      with open(f"/proc/{child}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
      if argv[2].endswith(b"cluster/service.py"):  # python -I service.py: its guard has exec'd.
        return child
    raise AssertionError("the launcher runs no coordination service")

  def host_pids(self) -> dict[int, int]:
    """The running hosts of the current attempt: {host id: pid}."""
    hosts = {}
    for child in self._children():
      try:
        with open(f"/proc/{child}/environ", "rb") as f:
          env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
      except OSError:
        continue  # Gone.
      if b"HETJAX_HOST_ID" in env:
        hosts[int(env[b"HETJAX_HOST_ID"])] = child
    return hosts

  def signal_hosts(self, hosts: list[int], signum: int) -> None:
    pids = self.host_pids()
    for h in hosts:
      os.kill(pids[h], signum)

  def finish(self) -> int:
    try:
      return self.proc.wait(timeout=DEADLINE_S)
    finally:
      self.kill()

  def kill(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()

  def text(self, start: int = 0) -> str:
    with self._seen:
      return "\n".join(self.lines[start:])
