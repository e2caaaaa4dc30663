"""The emulated hosts' compile lock saves work and never holds a host up for ever.

`hetjax.cluster.shared_programs.acquire` waits while another process compiles
the same program. A holder that a test froze with SIGSTOP would keep every
other host of both xdist workers waiting; a waiter compiles by itself instead.
The clock and the sleep are injected, so no test here reads a real clock.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from hetjax.cluster import shared_programs

# Takes the lock as `acquire` does (flock, then its pid in the file), says so, waits.
_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, str(os.getpid()).encode(), 0)
print("locked", flush=True)
sys.stdin.read()  # Until the test closes our stdin.
"""


class _FakeTime:
  """A clock that moves only when slept on; refuses to sleep past `max_sleeps`."""

  def __init__(self, max_sleeps: int = 1000):
    self.now, self.sleeps, self.max_sleeps = 0.0, 0, max_sleeps

  def clock(self) -> float:
    return self.now

  def sleep(self, seconds: float) -> None:
    self.sleeps += 1
    assert self.sleeps <= self.max_sleeps, "acquire kept waiting on a holder that cannot release"
    self.now += seconds


@pytest.fixture
def holder(tmp_path):
  """(lock path, the process holding it)."""
  path = str(tmp_path / "lock")
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, path], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "locked"
  yield path, proc
  proc.send_signal(signal.SIGCONT)
  proc.kill()
  proc.wait()


def _state(pid: int) -> str:
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


def test_a_waiter_compiles_alone_when_the_holder_is_stopped(holder):
  path, proc = holder
  proc.send_signal(signal.SIGSTOP)
  while _state(proc.pid) not in ("T", "t"):  # The signal is delivered asynchronously.
    os.sched_yield()
  time = _FakeTime()
  # No deadline in reach: only the holder's state can end the wait.
  assert shared_programs.acquire(path, wait_s=1e9, clock=time.clock, sleep=time.sleep) is None
  assert time.sleeps == 0


def test_a_waiter_waits_for_a_running_holder_up_to_its_limit(holder):
  path, _ = holder
  time = _FakeTime()
  assert shared_programs.acquire(path, wait_s=1.0, clock=time.clock, sleep=time.sleep) is None
  assert time.sleeps == pytest.approx(1.0 / shared_programs._POLL_S, abs=1)  # pylint: disable=protected-access


def test_the_lock_passes_on_when_its_holder_ends_and_names_the_new_holder(holder):
  path, proc = holder
  proc.stdin.close()  # The holder exits; its lock goes with it.
  proc.wait()
  time = _FakeTime()
  fd = shared_programs.acquire(path, wait_s=1e9, clock=time.clock, sleep=time.sleep)
  assert fd is not None
  try:
    assert os.pread(fd, 16, 0) == str(os.getpid()).encode()
    other = os.open(path, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # Held: nobody else may take it now.
      fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(other)
  finally:
    os.close(fd)


def test_a_cache_entry_is_written_under_another_name_then_renamed(tmp_path, monkeypatch):
  """A host's first look at the cache takes no lock: it must never see half an entry."""
  from jax._src import lru_cache  # The cache JAX writes entries with (private).
  if os.environ.get(shared_programs.SHARE_ENV) != "1" or not shared_programs.install():
    pytest.fail("the suite's conftest installs shared programs; this run did not")
  cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)  # JAX's default: no eviction.
  # The cache's own path type (etils' epath where installed, else pathlib).
  final = cache.path / f"key{lru_cache._CACHE_SUFFIX}"  # pylint: disable=protected-access
  written = []
  real_write = type(final).write_bytes

  def spy(path, data):
    written.append((path, final.exists()))
    return real_write(path, data)

  monkeypatch.setattr(type(final), "write_bytes", spy)
  cache.put("key", b"compiled program")
  assert [(p.name.endswith(".part"), seen) for p, seen in written] == [(True, False)]
  assert final.read_bytes() == b"compiled program"
  assert sorted(os.listdir(tmp_path)) == [final.name]  # No part left behind.
  cache.put("key", b"another")  # An entry already there stays as it is, as in JAX.
  assert final.read_bytes() == b"compiled program"
