"""One host of `hetjax.cluster.testing.run_hosts`: join the cluster, call, pickle the result.

    python -m hetjax.cluster._testing_child CALL_PICKLE RESULT_PICKLE

The result file holds `("ok", value)` or `("error", traceback_text)`.

Every host also writes the programs it compiles into JAX's persistent
compilation cache, when one is set (as the test suite's conftest does); see
`_cache_programs_on_every_host`.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
import warnings


def _write(path: str, payload: tuple) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    pickle.dump(payload, f)
  os.replace(tmp, path)  # The parent never reads half a file.


def _cache_programs_on_every_host() -> None:
  """Lets hosts 1, 2, ... write their programs to the persistent compilation cache too.

  JAX writes cache entries from process 0 only (so that hosts sharing a
  remote cache do not all write it). But on these emulated CPU clusters
  every program a host compiles, its own-device ones and its part of a
  cross-host one alike, is keyed by that host's device ids (observed with
  `jax_explain_cache_misses`: host 1's and host 2's keys of one program
  differ), so hosts 1, 2, ... never found an entry and compiled every
  program again in every launch, which was most of the multi-host tests'
  time (BUILD_NOTES.md, "Test suite"). Here every host writes its
  entries: distinct keys, distinct files. Uses JAX internals (jax 0.10.2);
  if they change, the cache is simply used as JAX alone uses it.
  """
  try:
    from jax._src import compilation_cache, compiler, config  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  real_write = getattr(compiler, "_cache_write", None)
  put = getattr(compilation_cache, "put_executable_and_time", None)
  if real_write is None or put is None:
    return

  def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
    if (host_callbacks
        or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
      # JAX's own rules for these (it skips them, and says why in its log).
      return real_write(cache_key, compile_time_secs, module_name, backend, executable,
                        host_callbacks)
    try:
      put(cache_key, module_name, executable, backend, int(compile_time_secs))
    except Exception as e:  # pylint: disable=broad-except
      warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: "
                    f"{type(e).__name__}: {e}")
    return None

  compiler._cache_write = cache_write  # pylint: disable=protected-access


def main(argv: list[str]) -> int:
  call_path, result_path = argv
  try:
    with open(call_path, "rb") as f:
      module, function, args, kwargs = pickle.load(f)
    from hetjax.cluster import runtime  # pylint: disable=g-import-not-at-top
    _cache_programs_on_every_host()
    runtime.initialize()
    value = getattr(importlib.import_module(module), function)(*args, **kwargs)
    payload = ("ok", value)
    pickle.dumps(payload)  # Fail here, with a traceback, if the value cannot travel.
  except BaseException:  # pylint: disable=broad-except
    _write(result_path, ("error", traceback.format_exc()))
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip atexit: JAX's distributed shutdown waits for every other host, and
    # they may be blocked in a collective that this host will never join.
    os._exit(1)  # pylint: disable=protected-access
  _write(result_path, payload)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
