"""The dynamic balancer on an emulated cluster: shares move, the math does not."""

import jax
import numpy as np

from hetjax.testing import run_hosts

SLOWDOWN_STEP = 16


def test_dynamic_balancer_moves_work_away_from_a_slowed_host_without_changing_the_math():
  # Host 2 becomes 6x slower (emulated by pacing) from step 16 on.
  results = run_hosts("_cluster_entries:dynamic_balancing", hosts=3, speeds=[1.0, 1.0, 1.0],
                      env={"HETJAX_SLOWDOWN": f"2:6@{SLOWDOWN_STEP}"}, timeout_s=600)
  shares = results[0]["shares"]
  # Invariant 3: every host held the same assignment at every step.
  assert all(r["shares"] == shares for r in results)
  assert all(sum(s) == 192 and min(s) >= 0 for s in shares)
  before, after = shares[SLOWDOWN_STEP - 1][2], shares[-1][2]
  assert after < before, f"host 2's share went {before} -> {after}; shares: {shares}"
  assert any(d["step"] >= SLOWDOWN_STEP for d in results[0]["decisions"])
  # Invariant 2 while shares move: the parameters of one device on the whole batch.
  reference = run_hosts("_cluster_entries:one_host_reference", hosts=1, args=(192, 8, len(shares)))[0]
  for a, b in zip(jax.tree.leaves(results[0]["params"]), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
