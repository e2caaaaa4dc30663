"""Emulated hosts share their compiled programs: one compiles, the others load it.

For the test suite's emulated clusters only (its conftest sets
`SHARE_ENV`; `hetjax.cluster._testing_child`, the warm host server and the
test process call `install`). Why: on 2 cores, 3 hosts that compile the
same program at once spend 3 compiles of CPU on it, and JAX's persistent
cache never lets one host load another's program on CPU, because the key
holds the host's device ids and its topology fingerprint (on GPU JAX strips
the device ids itself, so that hosts share entries). Here:

- every host writes its entries (JAX writes from process 0 only);
- a key holds the devices' kind, not their ids nor the host's topology, as
  JAX's own key does on GPU; the loaded program runs on the devices it is
  given, so each host runs it on its own;
- a host that misses takes a lock on the key and looks again before it
  compiles, so that hosts asking for one program at once compile it once.
  The lock only saves work, so no host waits on it for ever: a waiter
  whose holder is stopped (a test's SIGSTOP) or gone, or who has waited
  `LOCK_WAIT_S`, compiles the program itself;
- an entry appears whole or not at all (written under another name, then
  renamed): JAX writes it in place, and a host's first look, taken without
  the lock, could read half of it ("incomplete or truncated stream").

Uses JAX internals (jax 0.10.2); where they differ, the cache is used as
JAX alone uses it. Nothing here runs outside the test suite.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from typing import Callable
import warnings

SHARE_ENV = "HETJAX_TEST_SHARE_PROGRAMS"
LOCK_WAIT_S = 120.0  # Longer than any compile of the suite's; then compile it twice.
_POLL_S = 0.05
_held = threading.local()  # This thread's lock file, between a miss and its write.


def _holder_runs(fd: int) -> bool:
  """Whether the process whose pid the lock file holds can still release it.

  A stopped process (state T or t) holds its lock until someone resumes it,
  which in a test may be never; a zombie or missing one has released it.
  """
  try:
    pid = int(os.pread(fd, 16, 0) or b"0")
    with open(f"/proc/{pid}/stat", "rb") as f:
      state = f.read().rsplit(b")", 1)[1].split()[0]
  except (OSError, ValueError, IndexError):
    return True  # No pid yet (the holder writes it just after locking), or no /proc.
  return state not in (b"T", b"t", b"Z", b"X")


def acquire(path: str, wait_s: float = LOCK_WAIT_S,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> int | None:
  """The lock at `path` (a file descriptor; closing it releases), or None.

  None when the holder is stopped or `wait_s` has passed: the caller then
  compiles without the lock. The holder's pid goes into the file so that
  waiters can tell a stopped holder from a busy one.
  """
  fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
  deadline = clock() + wait_s
  while True:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if clock() < deadline and _holder_runs(fd):
        sleep(_POLL_S)
        continue
      os.close(fd)
      return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def install() -> bool:
  """Patches JAX's persistent cache as the module docstring says; True when done."""
  if os.environ.get(SHARE_ENV) != "1" or not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return False
  try:
    from jax._src import (  # pylint: disable=g-import-not-at-top
        cache_key, compilation_cache, compiler, config, lru_cache)
  except ImportError:
    return False
  needed = (getattr(compiler, "_cache_read", None), getattr(compiler, "_cache_write", None),
            getattr(compiler, "compile_or_get_cached", None),
            getattr(compilation_cache, "put_executable_and_time", None),
            getattr(cache_key, "_hash_serialized_compile_options", None),
            getattr(cache_key, "_hash_devices", None))
  cache_class = getattr(lru_cache, "LRUCache", None)
  suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
  if (any(f is None for f in needed) or cache_class is None or suffix is None
      or getattr(compiler, "_hetjax_shared", False)):
    return bool(getattr(compiler, "_hetjax_shared", False))
  real_read, real_write, real_compile, put, hash_options, hash_devices = needed
  real_put = cache_class.put
  locks = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "hetjax-locks")
  os.makedirs(locks, exist_ok=True)

  def read(module_name, key, *args, **kwargs):
    found = real_read(module_name, key, *args, **kwargs)
    if found[0] is not None or getattr(_held, "fd", None) is not None:
      return found
    # Another host compiling it holds the lock until it wrote the program.
    _held.fd = acquire(os.path.join(locks, key[-64:]))
    return real_read(module_name, key, *args, **kwargs)

  def write(key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
      return real_write(key, compile_time_secs, module_name, backend, executable, host_callbacks)
    try:
      put(key, module_name, executable, backend, int(compile_time_secs))
    except Exception as e:  # pylint: disable=broad-except
      warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: "
                    f"{type(e).__name__}: {e}")
    return None

  def compile_or_get_cached(*args, **kwargs):
    try:
      return real_compile(*args, **kwargs)
    finally:  # Written, failed or skipped: the next host may look.
      fd = getattr(_held, "fd", None)
      if fd is not None:
        _held.fd = None
        os.close(fd)  # Releases the lock.

  def whole_put(cache, key, value):
    if cache.eviction_enabled or not key:  # JAX's own bookkeeping (and its errors) then.
      return real_put(cache, key, value)
    path = cache.path / f"{key}{suffix}"
    if path.exists():
      return None
    part = cache.path / f".{key}.{os.getpid()}.{threading.get_ident()}.part"
    part.write_bytes(value)
    os.replace(part, path)
    return None

  cache_class.put = whole_put
  compiler._cache_read = read  # pylint: disable=protected-access
  compiler._cache_write = write  # pylint: disable=protected-access
  compiler.compile_or_get_cached = compile_or_get_cached
  cache_key._hash_serialized_compile_options = (  # pylint: disable=protected-access
      lambda h, options, strip_device_assignment=False: hash_options(
          h, options, strip_device_assignment=True))
  cache_key._hash_accelerator_config = hash_devices  # pylint: disable=protected-access
  compiler._hetjax_shared = True  # pylint: disable=protected-access
  return True
