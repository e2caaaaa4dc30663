"""The dynamic balancer on an emulated cluster: shares move, the math does not."""

import jax
import numpy as np

import _cluster_entries
from hetjax.testing import run_hosts

SLOWDOWN_STEP = 16
RECOVERY_STEP = 120
STEPS = 200
DEVICE_BATCHES = (4, 2)


def test_dynamic_balancer_moves_work_away_from_a_slowed_host_without_changing_the_math():
  # Two hosts with device batches of 4 and 2 blocks; host 1's device is 8x
  # slower from step 16 to step 120. Compute times are a recorded model
  # (samples x seconds per sample), not the clock, so the decisions are the
  # same in every run.
  results = run_hosts("_balancing_entries:dynamic_balancing_on_recorded_timings", hosts=2,
                      args=(STEPS, 1, 8.0, SLOWDOWN_STEP, RECOVERY_STEP, DEVICE_BATCHES),
                      timeout_s=600)
  shares = results[0]["shares"]
  # Invariant 3: every host held the same assignment at every step.
  assert all(r["shares"] == shares for r in results)
  assert all(sum(s) == 256 and min(s) >= 0 for s in shares)
  before, slow = shares[SLOWDOWN_STEP - 1][1], shares[RECOVERY_STEP - 1][1]
  # Equal speeds: an equal split. Then 8x slower: about 1/9 of the batch, in 16-sample blocks.
  assert before == 128, shares
  assert slow <= 256 / 9 + 16 and slow < 0.75 * before, f"host 1: {before} -> {slow}: {shares}"
  # Its speed back: back towards half the batch.
  assert shares[-1][1] >= 96, f"host 1 after step {RECOVERY_STEP}: {shares[-1][1]}: {shares}"
  decided = [d["step"] for d in results[0]["decisions"]]
  assert any(SLOWDOWN_STEP <= s < RECOVERY_STEP for s in decided)
  assert any(s >= RECOVERY_STEP for s in decided)
  # 200 dynamic steps of moving shares on device batches compile nothing after the start,
  # counted by a listener that heard the warm-up compile (a deaf one would pass the first).
  for r in results:
    assert r["device_batches"] == list(DEVICE_BATCHES)
    assert r["compiles_after_warmup"] == 0 and r["compiles_in_warmup"] > 0, r["compiles_in_warmup"]
  # Invariant 2 while shares move: the parameters of one device on the whole batch.
  reference = _cluster_entries.one_host_reference(256, 16, len(shares), optimizer_="sgd")
  for a, b in zip(jax.tree.leaves(results[0]["params"]), jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
