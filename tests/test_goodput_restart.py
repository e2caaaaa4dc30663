"""Where a killed and restarted job's time went: the phase records cover it, the redone steps are lost.

One tiny 2-host job with checkpoints: a host is SIGKILLed after the first
checkpoint, the launcher restarts both, the job finishes. The figures are
compared with one another (never a wall-clock time against a constant).
"""

import json
import os
import signal
import subprocess
import sys
import time

from hetjax.observe import goodput, report
from _warm_client import module_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(ckpt, out):
  return [sys.executable, os.path.join(ROOT, "launch", "local.py"), "--hosts", "2",
          "--max-restarts", "2", "--speeds", "1,1", "--device-sample-ms", "10",  # 80 ms steps.
          "--", *module_command("hetjax.cli"), "train",
          "--model", "mlp", "--optimizer", "sgd", "--lr", "0.1",
          "--global-batch", "16", "--microbatch", "4", "--steps", "40", "--ckpt-dir", str(ckpt),
          "--ckpt-every", "10", "--out", str(out), "--log-every", "0"]


def _kill_after_step(command, ckpt, out, victim, after):
  """Runs `command`; SIGKILLs host `victim` once checkpoint 10 is committed and the host has
  recorded step `after` (the steps after 10 are then redone); waits for the end. Returns the
  exit code, the launcher's stderr, and the newest checkpoint committed before the kill."""
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  path, deadline = os.path.join(out, "phases", f"host{victim}.jsonl"), time.monotonic() + 300
  try:
    while not (10 in _committed(ckpt) and _recorded(path, after)):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.02)  # A poll: what it waits for is a step, not a time.
    committed = max(_committed(ckpt))
    os.kill(host_pid(victim, str(ckpt)), signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return proc.returncode, err, committed


def host_pid(host: int, token: str) -> int | None:
  """The pid of hetjax.cli host `host` whose command line holds `token`, from /proc."""
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = f.read().split(b"\0")
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmd = f.read()
    except OSError:
      continue
    if token.encode() in cmd and f"HETJAX_HOST_ID={host}".encode() in env and b"hetjax.cli" in cmd:
      return int(entry)
  return None


def _committed(ckpt):
  """Steps whose checkpoint orbax has committed (in-progress ones carry a suffix)."""
  return [int(p) for p in os.listdir(ckpt) if p.isdigit()] if os.path.isdir(ckpt) else []


def _recorded(path, step):
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return any(f'"kind": "step", "step": {step},' in line for line in f)


def test_a_killed_and_restarted_job_accounts_for_its_wall_time_and_its_lost_steps(tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "run"
  returncode, stderr, committed = _kill_after_step(_command(ckpt, out), ckpt, out, victim=1,
                                                   after=13)
  assert returncode == 0 and "restart 1/2" in stderr, stderr[-3000:]
  job = goodput.read_job(str(out))
  assert [h.attempts for h in job.hosts] == [2, 2], stderr[-3000:]
  # The records account for the job's wall time: what no phase covers is under 2 %.
  assert abs(job.recorded_s - job.wall_s) <= 0.02 * job.wall_s, job.seconds
  assert abs(sum(job.seconds.values()) - job.wall_s) <= 1e-6 * job.wall_s
  assert job.seconds[goodput.RESTART_WAIT] > 0 and job.seconds[goodput.COMPUTE] > 0
  # Progress lost: the time the first attempt spent on the steps the second one redid.
  redone_s = []
  for host in job.hosts:
    attempts = goodput.attempts_of(goodput.read_lines(
        os.path.join(out, "phases", f"host{host.host}.jsonl")))
    resumed = attempts[1].start_step
    redone = [s for s in attempts[0].steps if s.step > resumed]
    assert resumed == committed and host.redone_steps == len(redone), (resumed, committed)
    redone_s.append(sum(s.step_s for s in redone))
  lost, expected = job.seconds[goodput.LOST], sum(redone_s) / len(redone_s)
  assert abs(lost - expected) <= 0.1 * expected, (lost, expected)
  # The summary carries the job's figures, and the report prints them.
  summary = json.loads((out / "summary.json").read_text())
  assert summary["goodput"]["attempts"] == 2 and 0 < summary["goodput"]["fraction"] < 1
  _, text = report.make_report(str(out))
  assert "where the time went" in text and "restart wait" in text and "achieved (emulated)" in text

