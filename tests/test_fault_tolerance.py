"""Checkpoints on emulated multi-host clusters: preemption and elastic resume."""

import os
import re
import signal
import sys

import jax
import numpy as np

from hetjax.testing import run_hosts

from _warm_client import module_command

import _cli_job
import _ckpt_entries
import _fault_job


def test_sigterm_to_one_host_makes_every_host_save_at_the_next_boundary_and_resume_exactly(tmp_path):
  results = run_hosts("_ckpt_entries:preempt_resume_and_reference", hosts=2,
                      args=(str(tmp_path), 1, 4, 9), timeout_s=600)
  for r in results:
    # Host 1 got the signal after step 4; the flag travelled in step 4's
    # reduction, and every host acts on it two steps later (step 5 was
    # already dispatched), so all saved the state after 6 steps and stopped.
    assert r["preempted"] == 6 and r["steps_done_first"] == 6
    assert r["resumed_from"] == 6
    assert r["digest"] == r["reference"]  # Bit for bit, same layout.


def test_elastic_resume_3x2_to_2x1_to_3x2_follows_the_one_host_trajectory(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  first = run_hosts("_ckpt_entries:train_until", hosts=3, devices_per_host=2,
                    args=(ckpt, 4, "4,24,36"), timeout_s=600)
  second = run_hosts("_ckpt_entries:train_until", hosts=2, devices_per_host=1,
                     args=(ckpt, 8), timeout_s=600)
  third = run_hosts("_ckpt_entries:train_until", hosts=3, devices_per_host=2,
                    args=(ckpt, 12), timeout_s=600)
  reference = _ckpt_entries.train_until(None, 12)  # One host, one device, in this process.
  assert [r["resumed_from"] for r in (first[0], second[0], third[0])] == [None, 4, 8]
  assert second[0]["shares"] == [(32, 32)] * 4
  for host in third:
    for a, b in zip(jax.tree.leaves(host["params"]), jax.tree.leaves(reference["params"]),
                    strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _checkpoints(ckpt):
  return [] if ckpt is None else ["--ckpt-dir", str(ckpt), "--ckpt-every", "20"]


def _launch(ckpt, out, extra=()):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return [sys.executable, os.path.join(root, "launch", "local.py"), "--hosts", "2", *extra, "--",
          *module_command("hetjax.cli"), "train", "--model", "mlp", "--optimizer", "sgd",
          "--lr", "0.1", "--global-batch", "32",
          "--microbatch", "4", "--steps", "200", *_checkpoints(ckpt),
          "--out", str(out), "--log-every", "0"]


# What a host must never print when a peer dies: a C++ fatal check or abort, a Python traceback.
_CRASH = re.compile(r"Check fail|^F\d{4} |SIGABRT|Abort|\*\*\* |Fatal|Traceback")


def test_host_0_killed_then_sigterm_mid_collective_resume_to_the_uninterrupted_digest(tmp_path):
  """kill -9 of host 0 (the launcher runs the coordination service beside it) -> host 1 says
  so in one line, the traceback in its log under --out -> restart; then SIGTERM to host 0
  while it waits in the reduction for host 1, slowed 50 x (emulated) on that attempt only,
  from 3 steps after its resume -> every host saves and exits 75 -> the preemption restart
  resumes there; the end is bit for bit the uninterrupted run's (a fixed equal split, so
  speeds do not change the sums)."""
  ref_log = str(tmp_path / "ref.log")
  ref = _fault_job.reference(_launch(None, tmp_path / "ref"), ref_log)
  ckpt, out = tmp_path / "ckpt", tmp_path / "run"
  command = _launch(ckpt, out)[_launch(ckpt, out).index("--") + 1:]
  command[command.index("--log-every") + 1] = "1"  # Host 0's step lines drive the test.
  job = _cli_job.Job(["--max-restarts", "1", "--max-preemptions", "1"],
                     _fault_job.on_attempt(command, 1,
                                           _fault_job.slow_after_resume(1, 50, ckpt)))
  try:
    # Host 1 is slow from 3 steps after the resume: at 5, host 0 waits in the reduction
    # nearly all the time when its SIGTERM comes.
    first, second, saved = _fault_job.kill_then_stop(job, ckpt, killed=0, stopped=[0],
                                                     steps_after_resume=5)
  finally:
    job.kill()
  _fault_job.finish_reference(ref, ref_log)
  text = job.text()
  assert first >= 20 and first % 20 == 0, text[-3000:]
  assert "host 0 failed with signal SIGKILL" in text
  restart = next(i for i, line in enumerate(job.lines) if "[launcher] restart 1/1" in line)
  survivor = [line[len("[host 1] "):] for line in job.lines[:restart]
              if line.startswith("[host 1] ")]
  said = [line for line in survivor if "error:" in line]
  assert len(said) == 1 and re.match(r"hetjax train: error: host 0 stopped responding at "
                                     r"step \d+: ", said[0]), "\n".join(survivor)
  assert not [line for line in survivor if _CRASH.search(line)], "\n".join(survivor)
  assert f"full traceback in {out / 'host1-error.log'}" in said[0]
  assert "Traceback (most recent call last)" in (out / "host1-error.log").read_text()
  assert saved == {0: second, 1: second} and second > first, text[-3000:]  # 75 on every host.
  assert re.search(r"\[host 0\] hetjax train: preempted: .*reached this host during step", text)
  assert "all hosts exited 0 after 1 restart and 1 preemption restart" in text
  summary, expected = _fault_job.summary(out), _fault_job.summary(tmp_path / "ref")
  assert summary["resumed_from"] == second
  assert summary["params_digest"] == expected["params_digest"]


def test_the_coordination_service_killed_is_named_and_the_job_restarts_from_its_checkpoint(
    tmp_path):
  """kill -9 of the coordination service that the launcher runs beside the hosts: JAX ends
  every host; each says so in one line, its C++ report in OUT/host<i>-error.log; the launcher
  names the service, not a host, and restarts the job from its checkpoint."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "run"
  command = _launch(ckpt, out)[_launch(ckpt, out).index("--") + 1:]
  command[:len(module_command("hetjax.cli"))] = [sys.executable, "-m", "hetjax.cli"]  # Cold.
  job = _cli_job.Job(["--max-restarts", "1"], command)
  try:
    _fault_job.wait_committed(ckpt, 20, job)
    os.kill(job.service_pid(), signal.SIGKILL)
    _, restarted = job.wait_for(r"\[launcher\] restart 1/1 after the coordination service "
                                r"stopped: signal SIGKILL \(")
    first, _ = _fault_job.resumed(job, restarted)
    assert job.finish() == 0, job.text()[-3000:]
  finally:
    job.kill()
  text = job.text()
  assert first >= 20 and "all hosts exited 0 after 1 restart." in text
  for h in (0, 1):
    said = [line for line in job.lines[:restarted] if line.startswith(f"[host {h}] hetjax: error")]
    assert len(said) == 1 and said[0].startswith(
        f"[host {h}] hetjax: error: JAX ended this host: the coordination service is gone"), text
    assert f"full report in {out / f'host{h}-error.log'}" in said[0]
    assert "Check failure stack trace" in (out / f"host{h}-error.log").read_text()
  assert not re.search(r"Check failure|^\[host \d\] (F\d{4} |\s+@\s+0x)", text, re.M), text
