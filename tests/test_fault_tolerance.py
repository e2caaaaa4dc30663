"""Checkpoints on emulated multi-host clusters: preemption and elastic resume."""

import os
import sys

import jax
import numpy as np

from hetjax.testing import killed_and_uninterrupted, run_hosts

import _ckpt_entries


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
          sys.executable, "-m", "hetjax.cli", "train", "--model", "mlp", "--optimizer", "sgd",
          "--lr", "0.1", "--global-batch", "32",
          "--microbatch", "4", "--steps", "200", *_checkpoints(ckpt),
          "--out", str(out), "--log-every", "0"]


def test_a_host_killed_mid_run_is_restarted_from_the_checkpoint_and_finishes_exactly(tmp_path):
  run, summary, expected = killed_and_uninterrupted(_launch, tmp_path, hosts=2)
  assert "resumed from" in run.stdout
  assert summary["resumed_from"] is not None and summary["resumed_from"] % 20 == 0
  assert summary["params_digest"] == expected["params_digest"], f"seed {run.seed}"