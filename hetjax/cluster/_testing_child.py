"""One host of `hetjax.cluster.testing.run_hosts`: join the cluster, call, pickle the result.

    python -m hetjax.cluster._testing_child CALL_PICKLE RESULT_PICKLE

The result file holds `("ok", value)` or `("error", traceback_text)`.

In the test suite, hosts share their compiled programs
(`hetjax.cluster.shared_programs`).
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback


def _write(path: str, payload: tuple) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    pickle.dump(payload, f)
  os.replace(tmp, path)  # The parent never reads half a file.


def main(argv: list[str]) -> int:
  call_path, result_path = argv
  try:
    with open(call_path, "rb") as f:
      module, function, args, kwargs = pickle.load(f)
    from hetjax.cluster import runtime, shared_programs  # pylint: disable=g-import-not-at-top
    shared_programs.install()
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
