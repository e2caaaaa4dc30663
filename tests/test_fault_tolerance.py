"""Checkpoints on emulated multi-host clusters: preemption and elastic resume."""

import jax
import numpy as np

from hetjax.testing import run_hosts

import _ckpt_entries


def test_sigterm_to_one_host_makes_every_host_save_at_the_next_boundary_and_resume_exactly(tmp_path):
  results = run_hosts("_ckpt_entries:preempt_resume_and_reference", hosts=2,
                      args=(str(tmp_path), 1, 4, 9), timeout_s=600)
  for r in results:
    # Host 1 got the signal after step 4; the flag reached every host in step
    # 5's reduction, so all saved the state after 5 steps and stopped there.
    assert r["preempted"] == 5 and r["steps_done_first"] == 5
    assert r["resumed_from"] == 5
    assert r["digest"] == r["reference"]  # Bit for bit, same layout.


def test_elastic_resume_3x2_to_2x1_to_3x2_follows_the_one_host_trajectory(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  first = run_hosts("_ckpt_entries:train_until", hosts=3, devices_per_host=2,
                    args=(ckpt, 4, "5,23,36"), timeout_s=600)
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
