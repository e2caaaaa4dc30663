"""Blocks of `m` positions: the unit that makes BatchNorm and dropout split-independent."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st

import _block_entries as be
import hetjax
from hetjax import models as zoo
from hetjax import blocks, trainer
from hetjax.cli import commands as cli
from hetjax.cli import flags
from hetjax.input import data
from hetjax.task import MASK
from hetjax.testing import run_hosts


# ---- Pure block arithmetic --------------------------------------------------

@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.integers(1, 8), st.integers(0, 7))
def test_block_shares_and_sample_shares_round_trip(block_shares, m, short):
  total_blocks = sum(block_shares)
  if total_blocks == 0:
    return
  batch = total_blocks * m - min(short, m - 1)  # The last block may be partial.
  samples = blocks.to_samples(block_shares, batch, m)
  assert sum(samples) == batch
  assert blocks.check_aligned(samples, batch, m) == samples
  assert blocks.to_blocks(samples, batch, m) == tuple(block_shares)


def test_a_split_that_cuts_a_block_is_refused_naming_the_nearest_valid_one():
  with pytest.raises(ValueError, match="cuts a block of 4 samples.*nearest valid assignment is 4,24,36"):
    blocks.check_aligned((5, 23, 36), 64, 4)
  assert blocks.check_aligned((4, 24, 34), 62, 4) == (4, 24, 34)  # Ends on the partial block.
  assert blocks.check_aligned((62, 0, 0), 62, 4) == (62, 0, 0)
  assert blocks.first_block((4, 24, 34), 2, 4) == 7


def test_the_equal_policy_splits_blocks_not_samples():
  b = blocks.make_block_balancer("equal", 62, 4, (2, 2, 2))
  assert b.shares(0) == (24, 20, 18)  # 16 blocks: 6, 5, 5; the last one has 2 samples.


def test_the_command_line_refuses_a_cut_block_before_jax_starts(monkeypatch):
  monkeypatch.setenv("HETJAX_NUM_HOSTS", "2")
  args = flags.parser().parse_args(["train", "--model", "mlp", "--steps", "1", "--global-batch",
                                    "64", "--microbatch", "16", "--assignment", "40,24"])
  with pytest.raises(ValueError, match="nearest valid assignment is 48,16"):
    cli._check_args(args)


def test_the_python_api_refuses_a_cut_block():
  with pytest.raises(ValueError, match="nearest valid assignment is 8,56"):
    trainer.TrainConfig(global_batch=64, microbatch=8, assignment=(5, 59)).validate()


# ---- Dropout masks and weights on emulated clusters -------------------------

@pytest.fixture(scope="module")
def masks():
  one = be.dropout_masks("equal")  # One host, one device: in this process.
  assert (jax.process_count(), jax.local_device_count()) == (1, 1)
  three = run_hosts("_block_entries:dropout_masks", hosts=3, devices_per_host=2,
                    args=((4, 24, 34),))
  return one, three


def _expected_mask(step, position):
  k, j = divmod(position, be.BLOCK)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(be.SEED), step), k)
  return np.asarray(jax.random.bernoulli(key, 0.5, (be.BLOCK, be.FEATURES)))[j]


def test_the_same_global_example_gets_the_same_mask_whatever_the_split(masks):
  (p_one, idx, shares_one), three = masks
  assert shares_one == (be.BATCH,)
  for p_three, idx_three, shares in three:
    assert shares == (4, 24, 34)
    np.testing.assert_array_equal(idx_three, idx)
    np.testing.assert_array_equal(p_three, p_one)
  for position, record in enumerate(idx):
    np.testing.assert_array_equal(p_one[record] > 0, _expected_mask(0, position))


def test_different_examples_on_different_hosts_get_different_masks(masks):
  (p_one, idx, _), _ = masks
  rows = p_one[idx] > 0
  host0, host1 = rows[:4], rows[4:28]  # The hosts' slices of the uneven split.
  for a in host0:
    assert not any(np.array_equal(a, b) for b in host1)
  assert len({r.tobytes() for r in rows}) == len(rows)


def test_a_weighted_loss_averages_over_weights_exactly_on_uneven_hosts():
  for got, expected in run_hosts("_block_entries:weighted", hosts=3, args=((4, 24, 34),)):
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert abs(expected) > 1e-3


# ---- The contract, checked before any step ----------------------------------

def _digits_task(loss):
  return hetjax.from_functions(lambda rng, b: {"w": jnp.zeros((64, 10))},
                               lambda p, b, rng: loss(b["x"].reshape(len(b["x"]), -1) @ p["w"], b))


def _trainer(task, source=None, **config):
  hetjax.initialize()
  return trainer.Trainer(task, optax.sgd(0.1), source or data.load("digits"),
                         trainer.TrainConfig(global_batch=12, microbatch=5, **config))


def _xent(logits, b):
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"])


@pytest.mark.parametrize("loss, message", [
    (lambda z, b: (_xent(z, b).mean(), {}), r"returned losses of shape \(\) .*not a mean"),
    (lambda z, b: (_xent(z, b), {"acc": (z.argmax(-1) == b["y"]).mean()}),
     r"metric 'acc' of shape \(\) .*not a mean"),
    (lambda z, b: (_xent(z, b), {"loss": _xent(z, b)}), "metric named 'loss'.*rename it"),
    (lambda z, b: (_xent(z, b), {"count": _xent(z, b)}), "metric named 'count'"),
    (lambda z, b: (_xent(z, b)[:, None], {}), r"losses of shape \(5, 1\)"),
])
def test_contract_violations_are_named_before_any_step(loss, message):
  # The Trainer refuses at construction: no step (no local program) ever runs.
  with pytest.raises(ValueError, match=message):
    _trainer(_digits_task(loss))


def test_a_dataset_feature_named_like_the_mask_is_refused():
  source = data.ArraySource({"x": np.zeros((20, 64), np.float32), MASK: np.ones(20, np.float32)})
  task = hetjax.from_functions(lambda rng, b: {"w": jnp.zeros(64)}, lambda p, b, r: (b["x"] @ p["w"], {}))
  with pytest.raises(ValueError, match="feature named 'hetjax.mask'.*rename the feature"):
    _trainer(task, source)


def test_padding_repeats_real_rows_so_a_loss_nan_on_zeros_stays_finite():
  # Tokens where 0 is padding; the loss averages over non-zero tokens, which is
  # 0/0 on an all-zero row. 12 samples in blocks of 5: the last block pads 3 rows.
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 5, (30, 6)).astype(np.float32)
  source = data.ArraySource({"t": tokens})

  def loss(p, b, r):
    n = jnp.sum(b["t"] != 0, axis=1)
    return jnp.sum((b["t"] - p["w"]) ** 2, axis=1) / n, {}

  tr = _trainer(hetjax.from_functions(lambda rng, b: {"w": jnp.zeros(())}, loss), source)
  tr.fit(3)
  assert np.isfinite(tr.history.loss).all() and np.isfinite(tr.params()["w"])


# ---- Adapters as people write Flax ------------------------------------------

class NoisyLinen(nn.Module):
  """Asks for a stream that is not 'dropout', sows intermediates, uses `training`."""

  @nn.compact
  def __call__(self, x, training: bool = False):
    x = nn.Dense(10)(x.reshape(x.shape[0], -1))
    self.sow("intermediates", "logits", x)
    if training:
      x = x + jax.random.normal(self.make_rng("noise"), x.shape)
    return x


class BatchNormWithoutMask(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Dense(10)(x.reshape(x.shape[0], -1))
    return nn.BatchNorm(use_running_average=not train)(x)


def _block(n=5):
  batch = data.load("digits")[np.arange(n)]
  batch[MASK] = np.ones(n, np.float32)
  return batch


def test_linen_adapter_finds_every_rng_stream_and_drops_sown_collections():
  task = hetjax.from_linen(NoisyLinen(), lambda z, b: (_xent(z, b), {}))
  params, state = task.init(jax.random.key(0), _block())
  assert state == {}
  train = jax.jit(task.loss)
  a, b = train(params, state, _block(), jax.random.key(1))[0], train(params, state, _block(), jax.random.key(2))[0]
  assert not np.allclose(a, b)  # 'noise' got a key from the block's key.
  evaluate = jax.jit(task.evaluation_loss())
  np.testing.assert_array_equal(evaluate(params, state, _block(), jax.random.key(1))[0],
                                evaluate(params, state, _block(), jax.random.key(2))[0])


@pytest.mark.parametrize("name", ["train", "training", "deterministic"])
def test_linen_adapter_recognises_every_mode_argument(name):
  train_value = name != "deterministic"

  class Mode(nn.Module):
    @nn.compact
    def __call__(self, x, **kw):
      assert set(kw) == {name}
      return nn.Dense(10)(x.reshape(x.shape[0], -1)) * (2.0 if kw[name] == train_value else 1.0)

  Mode.__call__.__signature__ = __import__("inspect").Signature([
      __import__("inspect").Parameter(p, __import__("inspect").Parameter.POSITIONAL_OR_KEYWORD)
      for p in ("self", "x", name)])
  task = hetjax.from_linen(Mode(), lambda z, b: (z[:, 0], {}))
  params, state = task.init(jax.random.key(0), _block())
  train = task.loss(params, state, _block(), jax.random.key(1))[0]
  evaluate = task.evaluation_loss()(params, state, _block(), jax.random.key(1))[0]
  np.testing.assert_allclose(train, 2 * evaluate, rtol=1e-6)


_SEEN = []  # (mask is None, train) of every call of TokenMaskLM.


class TokenMaskLM(nn.Module):
  """An LM whose `mask` is its own `[b, T]` padding mask, under the usual name."""

  @nn.compact
  def __call__(self, tokens, mask=None, train: bool = False):
    _SEEN.append((mask is None, train))
    x = nn.Embed(8, 4)(tokens)
    attention = nn.make_causal_mask(tokens)
    if mask is not None:  # hetjax's [b] mask here was: "Too many indices", naming nothing.
      attention = nn.combine_masks(attention, mask[:, None, None, :] > 0)
    x = nn.MultiHeadDotProductAttention(num_heads=1, deterministic=not train)(x, mask=attention)
    return nn.Dense(8)(x)


def _tokens(n=12, t=5):
  return data.ArraySource({"x": np.random.default_rng(0).integers(0, 8, (n, t), np.int32)})


@pytest.mark.parametrize("global_batch", [8, 6])  # Whole blocks of 4, and a partial one.
def test_a_module_that_takes_mask_and_train_trains_unchanged(global_batch):
  """hetjax's per-example mask reaches a module only through `mask_arg`; `train` is set."""
  _SEEN.clear()

  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["x"][:, 1:]).sum(1), {}

  hetjax.initialize()
  tr = hetjax.Trainer(hetjax.from_linen(TokenMaskLM(), loss), optax.sgd(0.1), _tokens(),
                      hetjax.TrainConfig(global_batch=global_batch, microbatch=4, seed=0))
  try:
    assert all(np.isfinite(tr.train_step()["loss"]) for _ in range(2))
    assert np.isfinite(tr.evaluate(_tokens())["loss"])
  finally:
    tr.close()
  assert {m for m, _ in _SEEN} == {True} and {t for _, t in _SEEN} == {True, False}


@pytest.mark.parametrize("kw", [{"mask_arg": "padding"}, {"call_args": {"padding": "x_mask"}}])
def test_mask_arg_and_call_args_name_arguments_of_the_module(kw):
  with pytest.raises(ValueError, match=rf"{next(iter(kw))} names 'padding', but "
                                       r"TokenMaskLM.__call__ takes \(tokens, mask=None"):
    hetjax.from_linen(TokenMaskLM(), lambda z, b: (z[:, 0, 0], {}), **kw)


def test_call_args_hand_batch_entries_to_the_module_in_training_and_evaluation():
  """A token padding mask reaches the module's own `mask=`; hetjax's mask stays out."""
  _SEEN.clear()
  task = hetjax.from_linen(TokenMaskLM(), lambda z, b: (z[:, 0, 0], {}), call_args={"mask": "m"})
  tokens = np.random.default_rng(0).integers(0, 8, (4, 5)).astype(np.int32)
  batch = {"x": tokens, "m": np.ones((4, 5), np.float32), MASK: np.ones(4, np.float32)}
  params, state = task.init(jax.random.key(0), batch)
  task.loss(params, state, batch, jax.random.key(1))
  task.evaluation_loss()(params, state, batch, jax.random.key(1))
  assert set(_SEEN) == {(False, True), (False, False)}  # (mask is None, train)


def test_nnx_call_args_hand_batch_entries_to_the_model():
  from flax import nnx

  class Weigh(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(()))

    def __call__(self, x, weights=None):
      return x.sum(1) * self.w * weights

  task = hetjax.from_nnx(Weigh(), lambda z, b: (z, {}), call_args={"weights": "w"})
  batch = {"x": np.ones((2, 3), np.float32), "w": np.array([1.0, 2.0], np.float32),
           MASK: np.ones(2, np.float32)}
  params, state = task.init(jax.random.key(0), batch)
  for loss in (task.loss, task.evaluation_loss()):
    np.testing.assert_array_equal(loss(params, state, batch, jax.random.key(1))[0], [3.0, 6.0])


@pytest.mark.parametrize("global_batch", [8, 6])
def test_batchnorm_blind_to_a_partial_blocks_padding_is_refused_before_compiling(global_batch):
  """8: whole blocks, no padding to count, it trains; 6: a block of 2 real rows and 2 padding."""
  hetjax.initialize()
  source = data.load("digits")
  config = hetjax.TrainConfig(global_batch=global_batch, microbatch=4, seed=0)
  blind = hetjax.from_linen(BatchNormWithoutMask(), lambda z, b: (_xent(z, b), {}))
  if global_batch % 4:
    with pytest.raises(ValueError, match=r"batch of 6 examples is not a whole number of blocks "
                       r"of 4.*2 real examples and 2 padding rows.*batch_stats.*"
                       r"Pass mask_arg='mask' to from_linen / from_nnx"):
      hetjax.Trainer(blind, optax.sgd(0.1), source, config)
    nnx_blind = hetjax.from_nnx(__import__("_exact_entries").nnx_model(), _exact_entries_loss)
    with pytest.raises(ValueError, match=r"model keeps batch statistics \(bn\)"):
      hetjax.Trainer(nnx_blind, optax.sgd(0.1), source, config)
    with pytest.raises(ValueError, match=r"batch of 6 examples"):  # A rounds mode's local step.
      hetjax.Trainer(blind, optax.sgd(0.1), source, hetjax.TrainConfig(global_batch=8, microbatch=4),
                     mode=hetjax.Hybrid(local_batch=6))
    return
  tr = hetjax.Trainer(blind, optax.sgd(0.1), source, config)
  try:
    assert np.isfinite(tr.train_step()["loss"])
  finally:
    tr.close()


def _exact_entries_loss(logits, batch):
  return _xent(logits, batch), {}


def test_nnx_adapter_keeps_rng_variables_out_of_the_state_and_evaluates_in_eval_mode():
  import _exact_entries
  task = hetjax.from_nnx(_exact_entries.nnx_model(), _exact_entries._classification)
  params, state = task.init(jax.random.key(0), _block())
  assert set(state) == {"bn"} and set(state["bn"]) == {"mean", "var"}
  evaluate = jax.jit(task.evaluation_loss())
  a, _, after = evaluate(params, state, _block(), jax.random.key(1))
  b, _, _ = evaluate(params, state, _block(), jax.random.key(2))
  np.testing.assert_array_equal(a, b)  # No dropout in evaluation,
  # and the running statistics: an example's loss ignores its batch-mates.
  c, _, _ = evaluate(params, state, {k: v[:1] for k, v in _block().items()}, jax.random.key(1))
  np.testing.assert_allclose(c[0], a[0], rtol=1e-5)
  assert jax.tree.all(jax.tree.map(np.array_equal, after, state))


def test_built_in_models_take_dropout_and_evaluate_deterministically():
  task = zoo.build("cnn", kind="image", num_classes=10, dropout=0.5)
  params, state = task.init(jax.random.key(0), _block())
  losses = [task.loss(params, state, _block(), jax.random.key(k))[0] for k in (1, 2)]
  assert not np.allclose(*losses)
  evals = [task.evaluation_loss()(params, state, _block(), jax.random.key(k))[0] for k in (1, 2)]
  np.testing.assert_array_equal(*evals)
