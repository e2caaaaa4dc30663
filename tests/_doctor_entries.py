"""`hetjax doctor` as a run_hosts entry: its exit code, and host 0's printout and JSON."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time

import jax

from hetjax.cluster import doctor

BATCH = 128


class RecordedClock:
  """`time` as the doctor's step timer sees it: every step takes `step_s`, whatever the load.

  Each `perf_counter()` call is `step_s` after the previous one, so a
  step's measured duration (the difference of two calls) is `step_s`
  exactly (a power of two keeps the sums exact); everything else is the
  real `time`, so the emulated pacing still sleeps.
  """

  def __init__(self, step_s: float):
    self.step_s, self.now = step_s, 0.0

  def perf_counter(self) -> float:
    self.now += self.step_s
    return self.now

  def __getattr__(self, name):
    return getattr(time, name)


def doctor_on_every_host(json_path: str, steps: int = 6, expect_devices: str | None = None,
                         recorded_step_s: float | None = None):
  """Runs `hetjax doctor`; with `recorded_step_s`, its speed test times steps on a RecordedClock."""
  printed = io.StringIO()
  extra = [] if expect_devices is None else ["--expect-devices", expect_devices]
  if recorded_step_s is not None:
    measure = doctor.time_steps

    def time_steps(*args, **kwargs):
      doctor.time = RecordedClock(recorded_step_s)  # This host process only.
      try:
        return measure(*args, **kwargs)
      finally:
        doctor.time = time

    doctor.time_steps = time_steps
  with contextlib.redirect_stdout(printed):
    code = doctor.main(["--steps", str(steps), "--batch", str(BATCH), "--json", json_path, *extra])
  report = None
  # Only process 0 writes the report; another host reading it could catch
  # the file half written.
  if jax.process_index() == 0 and os.path.exists(json_path):
    with open(json_path) as f:
      report = json.load(f)
  return code, printed.getvalue(), report
