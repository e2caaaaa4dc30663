"""Whole blocks skip the padding mask's work and still reach the oracle.

When the global batch is a whole number of blocks, every block is all real
or all padding (dropped whole), so the step runs the task's `unmasked_loss`:
a linen or NNX module called without `mask=`, i.e. plain BatchNorm
statistics, which XLA computes in fewer kernels. A batch with a partial
block keeps the masked loss. Either way the result is the semantics the
independent oracle of `test_exactness.py` writes out.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _exact_entries as ex
import hetjax
from hetjax.input import data
from hetjax.task import MASK
from test_exactness import assert_close, oracle

WHOLE = 64  # 16 blocks of `ex.BLOCK` positions.


class MaskProbe(nn.Module):
  """A zero output, plus 1 when the module was handed a mask."""

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    w = self.param("w", nn.initializers.zeros, (1,))
    return jnp.zeros((x.shape[0], 1)) + w + (0.0 if mask is None else 1.0)


def _probe_loss(outputs, batch):
  return outputs[:, 0], {}


def _batch(n=4):
  return {"x": np.zeros((n, 8, 8, 1), np.float32), "y": np.zeros(n, np.int32),
          MASK: np.ones(n, np.float32)}


def test_linen_adapter_has_an_unmasked_loss_only_for_modules_that_take_a_mask():
  task = hetjax.from_linen(MaskProbe(), _probe_loss, mask_arg="mask")
  params, state = task.init(jax.random.key(0), _batch())
  masked = task.loss(params, state, _batch(), jax.random.key(1))[0]
  unmasked = task.unmasked_loss(params, state, _batch(), jax.random.key(1))[0]
  np.testing.assert_array_equal(masked, 1.0)
  np.testing.assert_array_equal(unmasked, 0.0)
  assert task.training_loss(blocks_full=True) is task.unmasked_loss
  assert task.training_loss(blocks_full=False) is task.loss

  no_mask = hetjax.from_linen(nn.Dense(1), lambda out, b: (out[:, 0], {}))
  assert no_mask.unmasked_loss is None
  assert no_mask.training_loss(blocks_full=True) is no_mask.loss


class MaskRequired(nn.Module):
  @nn.compact
  def __call__(self, x, mask, train: bool = False):
    return nn.Dense(1)(x.reshape(x.shape[0], -1)) * mask[:, None]


def test_a_module_whose_mask_has_no_default_gets_no_unmasked_loss():
  """Calling it without `mask=` would fail, so whole blocks would keep the mask."""
  task = hetjax.from_linen(MaskRequired(), _probe_loss, mask_arg="mask")
  assert task.unmasked_loss is None
  assert task.training_loss(blocks_full=True) is task.loss


def test_nnx_adapter_has_an_unmasked_loss():
  from flax import nnx

  class Probe(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.zeros(1))

    def __call__(self, x, mask=None):
      return jnp.zeros((x.shape[0], 1)) + self.w + (0.0 if mask is None else 1.0)

  task = hetjax.from_nnx(Probe(), _probe_loss, mask_arg="mask")
  params, state = task.init(jax.random.key(0), _batch())
  np.testing.assert_array_equal(task.loss(params, state, _batch(), jax.random.key(1))[0], 1.0)
  np.testing.assert_array_equal(
      task.unmasked_loss(params, state, _batch(), jax.random.key(1))[0], 0.0)


def test_nnx_adapter_keeps_junk_padding_out_of_batchnorm():
  """A lost mask changes the result: a block of 3 real rows and 5 rows of large
  noise gives the real rows the losses and the running statistics of those 3
  rows alone (BatchNorm over a batch of 3, no padding at all)."""
  from flax import nnx

  class ConvBatchNorm(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
      self.head = nnx.Linear(4 * 64, 10, rngs=rngs)

    def __call__(self, x, mask=None):
      x = self.bn(self.conv(x), mask=None if mask is None else mask[:, None, None, None] > 0)
      return self.head(jax.nn.relu(x).reshape(x.shape[0], -1))

  def classify(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {}

  task = hetjax.from_nnx(ConvBatchNorm(nnx.Rngs(0)), classify, mask_arg="mask")
  rng = np.random.default_rng(0)
  real = {"x": rng.standard_normal((3, 8, 8, 1)).astype(np.float32),
          "y": np.array([1, 2, 3], np.int32), MASK: np.ones(3, np.float32)}
  padded = {"x": np.concatenate([real["x"], 1e3 * rng.standard_normal((5, 8, 8, 1))]).astype(
                np.float32),
            "y": np.concatenate([real["y"], np.zeros(5, np.int32)]),
            MASK: (np.arange(8) < 3).astype(np.float32)}
  params, state = task.init(jax.random.key(0), real)
  loss = jax.jit(task.loss)
  alone, _, alone_state = loss(params, state, real, jax.random.key(1))
  mixed, _, mixed_state = loss(params, state, padded, jax.random.key(1))
  np.testing.assert_allclose(mixed[:3], alone, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(mixed_state), jax.tree.leaves(alone_state), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(alone_state),
                                                   jax.tree.leaves(state))]
  assert any(moved)  # The running statistics were updated, so comparing them meant something.


@pytest.mark.parametrize("global_batch, masked", [(8, False), (6, True)])
def test_the_trainer_drops_the_mask_only_when_every_block_is_whole(global_batch, masked):
  """8 = two whole blocks of 4; 6 ends with a partial block, which needs the mask."""
  hetjax.initialize()
  n = 24
  source = data.ArraySource({"x": np.zeros((n, 8, 8, 1), np.float32),
                             "y": np.zeros(n, np.int32)})
  tr = hetjax.Trainer(hetjax.from_linen(MaskProbe(), _probe_loss, mask_arg="mask"), optax.sgd(0.0),
                      source,
                      hetjax.TrainConfig(global_batch=global_batch, microbatch=4, seed=0))
  try:
    assert tr.train_step()["loss"] == pytest.approx(1.0 if masked else 0.0)
  finally:
    tr.close()


@pytest.mark.parametrize("model", ["resnet10", "linen"])
def test_whole_blocks_match_the_oracle(model):
  """BatchNorm models trained on whole blocks (unmasked) reach the masked oracle."""
  params, state = oracle(model, WHOLE)
  got = ex.matrix("equal", models=(model,), reductions=("device",), global_batch=WHOLE)
  assert_close(got[(model, "device")][0], params, f"1x1 {model} params, whole blocks")
  assert_close(got[(model, "device")][1], state, f"1x1 {model} state, whole blocks")
