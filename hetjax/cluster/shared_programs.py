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

Uses JAX internals (jax 0.10.2); where they differ, the cache is used as
JAX alone uses it. Nothing here runs outside the test suite.
"""

from __future__ import annotations

import fcntl
import os
import threading
import warnings

SHARE_ENV = "HETJAX_TEST_SHARE_PROGRAMS"
_held = threading.local()  # This thread's lock file, between a miss and its write.


def install() -> bool:
  """Patches JAX's persistent cache as the module docstring says; True when done."""
  if os.environ.get(SHARE_ENV) != "1" or not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return False
  try:
    from jax._src import (  # pylint: disable=g-import-not-at-top
        cache_key, compilation_cache, compiler, config)
  except ImportError:
    return False
  needed = (getattr(compiler, "_cache_read", None), getattr(compiler, "_cache_write", None),
            getattr(compiler, "compile_or_get_cached", None),
            getattr(compilation_cache, "put_executable_and_time", None),
            getattr(cache_key, "_hash_serialized_compile_options", None),
            getattr(cache_key, "_hash_devices", None))
  if any(f is None for f in needed) or getattr(compiler, "_hetjax_shared", False):
    return bool(getattr(compiler, "_hetjax_shared", False))
  real_read, real_write, real_compile, put, hash_options, hash_devices = needed
  locks = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "hetjax-locks")
  os.makedirs(locks, exist_ok=True)

  def read(module_name, key, *args, **kwargs):
    found = real_read(module_name, key, *args, **kwargs)
    if found[0] is not None or getattr(_held, "fd", None) is not None:
      return found
    fd = os.open(os.path.join(locks, key[-64:]), os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # Another host compiling it holds it until it wrote.
    _held.fd = fd
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

  compiler._cache_read = read  # pylint: disable=protected-access
  compiler._cache_write = write  # pylint: disable=protected-access
  compiler.compile_or_get_cached = compile_or_get_cached
  cache_key._hash_serialized_compile_options = (  # pylint: disable=protected-access
      lambda h, options, strip_device_assignment=False: hash_options(
          h, options, strip_device_assignment=True))
  cache_key._hash_accelerator_config = hash_devices  # pylint: disable=protected-access
  compiler._hetjax_shared = True  # pylint: disable=protected-access
  return True
