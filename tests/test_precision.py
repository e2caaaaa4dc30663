"""Mixed precision: bf16 / fp16 compute, float32 master parameters and
sums, fp16 dynamic loss scaling decided the same on every host."""

import jax
import numpy as np
import pytest

from hetjax.testing import run_hosts
from hetjax import trainer

import _precision_entries as entries


@pytest.fixture(scope="module")
def three_hosts():
  """One 3-host cluster runs both multi-host tests' training: starting it is a large part.

  100 steps of adam(3e-3): one host reaches 0.983 in both precisions (150
  of adam(1e-3), the earlier setting, 0.981-0.986).
  """
  return run_hosts("_precision_entries:accuracy_and_overflow", hosts=3, args=(100,),
                   timeout_s=900)


def test_bf16_and_fp16_train_the_digits_cnn_on_three_uneven_hosts(three_hosts):
  results = [r["accuracy"] for r in three_hosts]
  for precision in ("bf16", "fp16"):
    accuracies = [r[precision]["accuracy"] for r in results]
    assert accuracies[0] >= 0.97, f"{precision}: test accuracy {accuracies[0]:.4f} < 0.97"
    assert accuracies == [accuracies[0]] * 3  # Every host holds the same parameters.
  assert results[0]["fp16"]["final_metrics"]["skipped"] == 0.0


def test_an_overflow_on_one_host_skips_that_step_everywhere_and_halves_the_scale(three_hosts):
  results = [r["overflow"] for r in three_hosts]
  step = entries.OVERFLOW_STEP
  for name in ("clean", "boom"):
    # Invariant 3: every host decided the same at every step.
    assert all(r[name]["metrics"] == results[0][name]["metrics"] for r in results)
  clean, boom = results[0]["clean"], results[0]["boom"]
  assert [m["skipped"] for m in clean["metrics"]] == [0.0] * len(clean["metrics"])
  assert [m["skipped"] for m in boom["metrics"]] == [float(s == step) for s in range(len(boom["metrics"]))]
  scales = [m["loss_scale"] for m in boom["metrics"]]  # The scale each step used.
  assert scales[step + 1] == scales[step] / 2 and scales[step] == scales[0] == 2.0 ** 15
  # The skipped step left the parameters as they were; the others moved them.
  for before, after, skipped in zip(boom["params"], boom["params"][1:], [m["skipped"] for m in boom["metrics"]]):
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    assert same == bool(skipped)
  # Up to the bad step both runs are one run.
  for a, b in zip(clean["params"][:step + 1], boom["params"][:step + 1]):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y)


def test_an_unknown_precision_fails_before_anything_compiles():
  with pytest.raises(ValueError, match="unknown precision 'fp8'; choose one of fp32, bf16, fp16"):
    trainer.TrainConfig(global_batch=8, precision="fp8").validate()
