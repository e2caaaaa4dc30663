"""Host functions for tests/test_warm_hosts.py."""

import os
import time


def describe_process() -> dict:
  import jax
  return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
          "index": jax.process_index(), "devices": jax.local_device_count(),
          "mark": os.environ.get("HETJAX_TEST_MARK")}


def fail_on_host_1() -> None:
  import jax
  if jax.process_index() == 1:
    1 / 0


def sleep_and_report(path: str) -> None:
  with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
  os.replace(path + ".tmp", path)
  time.sleep(600)
