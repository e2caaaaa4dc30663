"""`hetjax doctor` as a run_hosts entry: its exit code, and host 0's printout and JSON."""

from __future__ import annotations

import contextlib
import io
import json
import os

import jax

from hetjax.cluster import doctor


def doctor_on_every_host(json_path: str, steps: int = 6, expect_devices: str | None = None):
  printed = io.StringIO()
  extra = [] if expect_devices is None else ["--expect-devices", expect_devices]
  with contextlib.redirect_stdout(printed):
    code = doctor.main(["--steps", str(steps), "--batch", "128", "--json", json_path, *extra])
  report = None
  # Only process 0 writes the report; another host reading it could catch
  # the file half written.
  if jax.process_index() == 0 and os.path.exists(json_path):
    with open(json_path) as f:
      report = json.load(f)
  return code, printed.getvalue(), report
