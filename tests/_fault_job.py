"""One training run hit by several faults, beside an uninterrupted one: the shared steps.

A test builds both runs' commands, starts the reference in the background,
drives the faulted run through `_cli_job.Job` (what it prints, which host
gets which signal) and compares the two summaries at the end. Every wait is
on a printed line or a committed checkpoint, never on the clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import _cli_job

def on_attempt(command: list[str], attempt: int, exports: str) -> list[str]:
  """`command` with the shell text `exports` (e.g. `export HETJAX_SLOWDOWN=1:50@23`) run first
  on that attempt (HETJAX_RESTART_COUNT) only."""
  quoted = " ".join(f"'{c}'" for c in command)
  return ["sh", "-c", f'if [ "$HETJAX_RESTART_COUNT" = {attempt} ]; then {exports}; fi; '
                      f"exec {quoted}"]


def slow_after_resume(host: int, factor: int, ckpt, steps: int = 3) -> str:
  """Shell text: `host` becomes `factor` x slower `steps` steps after the newest checkpoint
  (emulated), so the steps that compile, which the pacing would stretch too, stay fast."""
  return (f'newest=$(ls {ckpt} | grep -xE "[0-9]+" | sort -n | tail -n 1); '
          f"export HETJAX_SLOWDOWN={host}:{factor}@$((newest + {steps}))")


def reference(command: list[str], log: str) -> subprocess.Popen:
  """The uninterrupted run, in the background beside the faulted one (its output in `log`)."""
  with open(log, "w") as f:
    return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=_cli_job.ROOT)


def finish_reference(proc: subprocess.Popen, log: str) -> None:
  try:
    assert proc.wait(timeout=_cli_job.DEADLINE_S) == 0, open(log).read()[-3000:]
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def wait_committed(ckpt, step: int, job: _cli_job.Job) -> None:
  """Waits until checkpoint `step` is committed in `ckpt` (orbax renames it into place)."""
  deadline = time.monotonic() + _cli_job.DEADLINE_S
  while not os.path.isdir(os.path.join(ckpt, str(step))):
    assert job.proc.poll() is None and time.monotonic() < deadline, job.text()[-3000:]
    time.sleep(0.05)  # A poll: what it waits for is the folder, not a time.


def resumed(job: _cli_job.Job, start: int) -> tuple[int, int]:
  """(the step host 0 resumed from, the line's index) after line `start`."""
  found, at = job.wait_for(r"\[host 0\] hetjax: resumed (?:elastic )?from \S+/(\d+)\b", start)
  return int(found.group(1)), at


def preempted(job: _cli_job.Job, start: int, end: int) -> dict[int, int]:
  """{host: the step its checkpoint saved} from each host's preemption line between two lines."""
  found = {}
  for line in job.lines[start:end]:
    m = re.search(r"\[host (\d)\] hetjax train: preempted: checkpoint of (?:step|round) (\d+) "
                  r"saved in "
                  r"\S+; exiting with code 75", line)
    if m:
      found[int(m.group(1))] = int(m.group(2))
  return found


def kill_then_stop(job: _cli_job.Job, ckpt, killed: int, stopped: list[int],
                   steps_after_resume: int) -> tuple[int, int, dict[int, int]]:
  """kill -9 of host `killed` once checkpoint 20 is committed, the launcher's restart, then
  SIGTERM to `stopped` `steps_after_resume` steps after the resume, the preemption restart.

  Returns (the step the restart resumed from, the step the preemption's resume started at,
  {host: the step its preemption checkpoint saved}), after the job finished with 0.
  """
  wait_committed(ckpt, 20, job)
  job.signal_hosts([killed], signal.SIGKILL)
  _, restarted = job.wait_for(
      rf"\[launcher\] restart 1/1 after host {killed} failed with signal SIGKILL")
  first, at = resumed(job, restarted)
  job.wait_for_step(first + steps_after_resume, at)
  job.signal_hosts(stopped, signal.SIGTERM)
  _, again = job.wait_for(r"\[launcher\] preemption restart 1/1 after", at)
  saved = preempted(job, at, again)
  second, _ = resumed(job, again)
  assert job.finish() == 0, job.text()[-3000:]
  return first, second, saved


def summary(out) -> dict:
  with open(os.path.join(out, "summary.json")) as f:
    return json.load(f)
