"""Tests for the model registry (`models/`, installed as `hetjax_models`).

Every model must give per-example losses and metrics, because hetjax sums them
over real examples across hosts; BatchNorm must ignore padded examples.
Widths are tiny so the whole file runs in seconds on CPU.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hetjax import fast_variance
from hetjax import models as zoo
from hetjax import task as task_lib
from hetjax.models import losses
from hetjax.task import MASK

NUM_CLASSES = 5
VOCAB = 11
TINY = {
    "mlp": {"hidden": (16,)},
    "cnn": {"features": (4, 8), "hidden": 16},
    # BatchNorm masking does not depend on depth; one block per stage, two
    # stages (one with a projection shortcut) keep compilation short.
    # test_default_configs_build covers the full [2, 2, 2, 2] network.
    "resnet18": {"width": 4, "stage_sizes": (1, 1)},
    "resnet50": {"width": 2, "stage_sizes": (1, 1)},
    "transformer": {"d_model": 16, "num_heads": 2, "num_layers": 1,
                    "max_len": 16},
}
NON_BN = ("mlp", "cnn", "transformer")
B = 6  # One batch size throughout, so each model compiles once.
_FAST_COMPILE = {"xla_backend_optimization_level": 0,
                 "xla_llvm_disable_expensive_passes": True}


def _key(seed):
  # XLA:CPU compiles threefry-based initializers slowly (tens of seconds for a
  # ResNet); rbg keys keep this file fast and exercise the same model code.
  return jax.random.key(seed, impl="rbg")


def _jit(fn):
  """`jax.jit` with XLA's cheap backend passes, returning numpy arrays.

  Each program here runs a handful of times on tiny inputs, so compilation
  is nearly all the cost: the cheap passes roughly halve it on CPU, and
  checking results in numpy avoids compiling every eager jnp op.
  """
  compiled = {}

  def call(*args):
    signature = tuple(
        (jnp.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(args))
    signature += (jax.tree.structure(args),)
    if signature not in compiled:
      compiled[signature] = jax.jit(fn).lower(*args).compile(_FAST_COMPILE)
    return jax.tree.map(np.asarray, compiled[signature](*args))

  return call


def _kind(name):
  return "tokens" if name == "transformer" else "image"


def _batch(name, seed=0):
  rng = np.random.default_rng(seed)
  if _kind(name) == "tokens":
    batch = {"x": rng.integers(0, VOCAB, (B, 8)).astype(np.int32)}
  else:
    batch = {"x": rng.normal(size=(B, 8, 8, 1)).astype(np.float32),
             "y": rng.integers(0, NUM_CLASSES, B).astype(np.int32)}
  batch[MASK] = np.ones(B, np.float32)
  return batch


@functools.cache
def _setup(name):
  """(task, jitted loss, params, model state) for tiny `name`, built once."""
  task = zoo.build(
      name, kind=_kind(name), num_classes=NUM_CLASSES, vocab_size=VOCAB,
      **TINY[name])
  params, state = _jit(task.init)(_key(0), _batch(name))
  return task, _jit(task.loss), params, state


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y)))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_losses_and_metrics_are_per_example_and_finite(name):
  _, loss_fn, params, state = _setup(name)
  loss, metrics, new_state = loss_fn(params, state, _batch(name), _key(1))
  loss, weights = task_lib.split_losses(loss)  # The token model: Weighted by token counts.
  weights = np.ones(B) if weights is None else weights
  assert loss.shape == weights.shape == (B,) and loss.dtype == np.float32
  assert np.all(np.isfinite(loss))
  assert set(metrics) == {"accuracy"}
  acc = metrics["accuracy"] / weights
  assert acc.shape == (B,) and np.all((acc >= 0) & (acc <= 1))
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  assert ("batch_stats" in state) == name.startswith("resnet")


@pytest.mark.parametrize("name", NON_BN)
def test_changing_one_example_changes_only_its_loss(name):
  _, loss_fn, params, state = _setup(name)
  batch = _batch(name, seed=0)
  changed = {k: v.copy() for k, v in batch.items()}
  changed["x"][2] = _batch(name, seed=1)["x"][2]
  loss = task_lib.split_losses(loss_fn(params, state, batch, _key(1))[0])[0]
  loss2 = task_lib.split_losses(loss_fn(params, state, changed, _key(1))[0])[0]
  np.testing.assert_array_equal(np.delete(loss2, 2), np.delete(loss, 2))
  assert loss2[2] != loss[2]


def test_transformer_is_causal():
  model = zoo.TransformerLM(vocab_size=VOCAB, **TINY["transformer"])
  _, _, params, _ = _setup("transformer")
  apply = _jit(lambda x: model.apply({"params": params}, x))
  tokens = _batch("transformer")["x"]
  changed = tokens.copy()
  changed[:, 5] = (changed[:, 5] + 1) % VOCAB
  logits, logits2 = apply(tokens), apply(changed)
  assert logits.shape == (B, 8, VOCAB)
  np.testing.assert_allclose(logits2[:, :5], logits[:, :5], atol=1e-6)
  assert np.max(np.abs(logits2[:, 5:] - logits[:, 5:])) > 1e-4


def test_next_token_loss_pairs_position_t_with_token_t_plus_1():
  tokens = np.array([[1, 2, 3, 4]], np.int32)
  # Predicts token t + 1 at position t for the first two targets only.
  logits = 10.0 * np.eye(5, dtype=np.float32)[[[2, 3, 0, 0]]]
  loss, metrics = _jit(losses.next_token)(logits, {"x": tokens})
  np.testing.assert_allclose(loss.weights, [3.0])  # Every token real: 3 targets.
  np.testing.assert_allclose(metrics["accuracy"], [2.0])  # Correct tokens; / weights: 2/3.
  log_probs = logits[0, :3] - np.log(np.exp(logits[0, :3]).sum(-1))[:, None]
  expected = -log_probs[np.arange(3), tokens[0, 1:]].sum()
  np.testing.assert_allclose(loss.values, [expected], rtol=1e-5)


def test_next_token_loss_sums_the_real_tokens_and_counts_them():
  """A padding mask [b, T]: a target counts when it and its input are real; padding of any
  value changes nothing; the weights are the token counts (a plain loop's sum(mask))."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (3, 6)).astype(np.int32)
  logits = rng.standard_normal((3, 6, VOCAB)).astype(np.float32)
  lengths = np.array([6, 3, 1])
  mask = (np.arange(6) < lengths[:, None]).astype(np.float32)
  loss, metrics = _jit(losses.next_token)(logits, {"x": tokens, losses.TOKEN_MASK: mask})
  np.testing.assert_array_equal(loss.weights, [5, 2, 0])
  per_token = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))
  np.testing.assert_allclose(loss.values, [per_token[i, :n - 1].sum() for i, n in enumerate(lengths)],
                             rtol=1e-5)
  junk = tokens.copy()
  junk[1, 3:], junk[2, 1:] = 7, 0
  other, _ = _jit(losses.next_token)(np.where(mask[..., None] > 0, logits, 1e3),
                                     {"x": junk, losses.TOKEN_MASK: mask})
  np.testing.assert_allclose(other.values, loss.values, rtol=1e-6)
  assert metrics["accuracy"].shape == (3,)


def _padded(pad_seed, num_real=4):
  """The first `num_real` examples are real; the rest are masked-out junk."""
  batch = _batch("resnet18", seed=0)
  batch["x"][num_real:] = 100.0 * _batch("resnet18", pad_seed)["x"][num_real:]
  batch[MASK][num_real:] = 0.0
  return batch


def test_resnet_batch_norm_ignores_padded_examples():
  _, loss_fn, params, state = _setup("resnet18")
  loss, _, stats = loss_fn(params, state, _padded(1), _key(1))
  loss2, _, stats2 = loss_fn(params, state, _padded(2), _key(1))
  # Junk of a very different scale in the padding moves nothing.
  np.testing.assert_allclose(loss2[:4], loss[:4], rtol=1e-5, atol=1e-6)
  assert _max_diff(stats, stats2) < 1e-5
  assert _max_diff(stats, state) > 1e-3  # Real examples do move the stats.
  # The statistics are those of the real examples alone.
  x = np.pad(_padded(1)["x"][:4], ((0, 0), (1, 1), (1, 1), (0, 0)))
  kernel = params["stem_conv"]["kernel"]  # [3, 3, 1, width]
  # The stem is a bias-free 3x3 "SAME" conv; its mean over real examples:
  stem = sum(np.einsum("bhwc,cf->bhwf", x[:, i:i + 8, j:j + 8], kernel[i, j])
             for i in range(3) for j in range(3))
  momentum = zoo.default_config("resnet18")["momentum"]
  old_mean = state["batch_stats"]["stem_norm"]["mean"]
  expected = momentum * old_mean + (1 - momentum) * stem.mean(axis=(0, 1, 2))
  np.testing.assert_allclose(
      stats["batch_stats"]["stem_norm"]["mean"], expected, atol=1e-5)


def test_resnet_all_padding_keeps_stats_and_stays_finite():
  task, loss_fn, params, state = _setup("resnet18")
  batch = _padded(1, num_real=0)
  loss, metrics, stats = loss_fn(params, state, batch, _key(1))
  assert np.all(np.isfinite(loss)) and np.all(np.isfinite(metrics["accuracy"]))
  assert _max_diff(stats, state) == 0.0

  @_jit
  def grads(p):
    masked_sum = lambda p: jnp.sum(
        task.loss(p, state, batch, _key(1))[0] * batch[MASK])
    return jax.grad(masked_sum)(p)

  assert all(np.all(g == 0) for g in jax.tree.leaves(grads(params)))


def test_resnet_eval_uses_running_averages():
  model = zoo.ResNet(num_classes=NUM_CLASSES, **TINY["resnet18"])
  _, _, params, state = _setup("resnet18")
  apply = _jit(
      lambda x: model.apply({"params": params, **state}, x, train=False))
  batch = _batch("resnet18", seed=0)
  other = _padded(1, num_real=1)  # Same first example, other batch-mates.
  # Normalized with stored statistics, an example ignores its batch-mates.
  np.testing.assert_allclose(
      apply(other["x"])[0], apply(batch["x"])[0], rtol=1e-5, atol=1e-6)


def test_cnn_adam_steps_reduce_loss():
  task, _, params, state = _setup("cnn")
  batch = _batch("cnn")
  opt = optax.adam(1e-2)

  def mean_loss(p):
    return jnp.mean(task.loss(p, state, batch, _key(0))[0])

  @_jit
  def step(p, o):
    loss, grads = jax.value_and_grad(mean_loss)(p)
    updates, o = opt.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  opt_state = opt.init(params)
  losses_seen = []
  for _ in range(10):
    params, opt_state, loss = step(params, opt_state)
    losses_seen.append(float(loss))
  assert losses_seen[-1] < 0.5 * losses_seen[0]


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_default_configs_build(name):
  """Full-size defaults trace (shapes only, nothing computed)."""
  task = zoo.build(
      name, kind=_kind(name), num_classes=10, vocab_size=VOCAB)
  batch = _batch(name)
  params, _ = jax.eval_shape(task.init, _key(0), batch)
  count = sum(x.size for x in jax.tree.leaves(params))
  if name == "resnet18":
    assert 11.1e6 < count < 11.3e6  # The usual CIFAR ResNet-18 size.
  if name == "resnet50":
    # 25.56M with a 1000-class head; 2.03M fewer with 10 classes.
    assert 23.4e6 < count < 23.6e6
    assert len(jax.tree.leaves(params)) == 161


def test_overrides_reach_the_module():
  task = zoo.build("resnet18", kind="image", num_classes=3, width=8)
  params, _ = jax.eval_shape(task.init, _key(0), _batch("resnet18"))
  assert params["stem_conv"]["kernel"].shape == (3, 3, 1, 8)
  assert params["head"]["kernel"].shape == (64, 3)
  assert "stage4_block2" in params


def test_resnet50_bottlenecks_and_overrides():
  task = zoo.build("resnet50", kind="image", num_classes=3, width=8)
  params, state = jax.eval_shape(task.init, _key(0), _batch("resnet50"))
  block = params["stage2_block1"]
  # 1x1 reduce to 2 * 8, 3x3, 1x1 expand to 4 * 16; projected shortcut.
  assert block["Conv_0"]["kernel"].shape == (1, 1, 32, 16)
  assert block["Conv_1"]["kernel"].shape == (3, 3, 16, 16)
  assert block["Conv_2"]["kernel"].shape == (1, 1, 16, 64)
  assert block["proj_conv"]["kernel"].shape == (1, 1, 32, 64)
  assert params["head"]["kernel"].shape == (8 * 4 * 8, 3)
  assert "stage4_block3" in params and "stage4_block4" not in params
  assert len(jax.tree.leaves(state)) == 106


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "vgg", "kind": "image", "num_classes": 10},
     "Unknown model 'vgg'; choose one of mlp, cnn, resnet18, transformer"),
    ({"name": "transformer", "kind": "image", "num_classes": 10},
     "model 'transformer' needs token data; dataset kind is 'image'"),
    ({"name": "cnn", "kind": "tokens", "vocab_size": 10},
     "model 'cnn' needs image data; dataset kind is 'tokens'"),
    ({"name": "cnn", "kind": "audio", "num_classes": 10},
     "Unknown dataset kind 'audio'; choose one of image, tokens"),
    ({"name": "mlp", "kind": "image"}, "needs num_classes >= 1; got None"),
    ({"name": "transformer", "kind": "tokens"},
     "needs vocab_size >= 1; got None"),
    ({"name": "cnn", "kind": "image", "num_classes": 10, "width": 8},
     r"Unknown option\(s\) \['width'\] for model 'cnn'; valid options: "),
])
def test_registry_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    zoo.build(**kwargs)


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_the_jax_free_catalog_lists_each_models_options(name):
  """The CLI checks options against the catalog before JAX loads; it must match the modules."""
  assert zoo.OPTIONS[name] == tuple(zoo.default_config(name))


# ---- the variance every built-in norm layer computes ----------------------------
# Flax's default `use_fast_variance=True` (E[x^2] - E[x]^2) amplifies the rounding
# of kernels of another shape: with it, ResNet-18's first update on 3x2 with
# device batches 4, 2, 1 moved 8.7e-4 from one device's, with the stable
# variance 4.1e-6 (bench/device_batch_exactness.py, docs/model.md).


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_every_built_in_norm_layer_computes_the_stable_variance(name):
  """Traced abstractly: no norm layer with Flax's fast variance (the tiny configs have every
  kind of norm the full ones have: a stem, blocks, a projection shortcut, a final norm)."""
  task = zoo.build(name, kind=_kind(name), num_classes=NUM_CLASSES, vocab_size=VOCAB,
                   **TINY[name])
  batch = _batch(name)
  params, state = jax.eval_shape(task.init, _key(0), batch)
  assert fast_variance.find(task.loss, params, state, batch, task.fast_variance_layers) == ()


class _FlaxDefaults(nn.Module):
  """Norm layers as Flax builds them by default, one of each kind, and one opted out."""

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    mask = None if mask is None else mask[:, None, None, None] > 0
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x, mask=mask)
    x = nn.LayerNorm(name="ln")(x)
    x = nn.GroupNorm(num_groups=2)(x)
    x = nn.RMSNorm()(x)  # No mean subtracted: nothing to cancel.
    x = nn.BatchNorm(use_running_average=not train, use_fast_variance=False)(x, mask=mask)
    return nn.Dense(NUM_CLASSES)(x.reshape(x.shape[0], -1))


def test_the_finder_names_every_fast_variance_layer_of_linen_and_nnx():
  """Guards the test above: the finder sees Flax's defaults (a blind finder would pass it)."""
  from flax import nnx
  task = task_lib.from_linen(_FlaxDefaults(), lambda logits, b: (
      optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), {}), mask_arg="mask")
  batch = _batch("cnn")
  params, state = jax.eval_shape(task.init, _key(0), batch)
  assert fast_variance.find(task.loss, params, state, batch, task.fast_variance_layers) == (
      "BatchNorm_0", "ln", "GroupNorm_0")

  class Nnx(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)
      self.ln = nnx.LayerNorm(4, rngs=rngs)
      self.stable = nnx.BatchNorm(4, use_fast_variance=False, rngs=rngs)

    def __call__(self, x, mask=None):
      mask = None if mask is None else mask[:, None, None, None] > 0
      x = self.stable(self.ln(self.bn(self.conv(x), mask=mask)), mask=mask)
      return x.reshape(x.shape[0], -1)[:, :NUM_CLASSES]

  task = task_lib.from_nnx(Nnx(nnx.Rngs(0)), lambda logits, b: (
      optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), {}), mask_arg="mask")
  assert task.fast_variance_layers == ("bn", "ln")
  params, state = jax.eval_shape(task.init, _key(0), batch)
  assert fast_variance.find(task.loss, params, state, batch, task.fast_variance_layers) == ("bn", "ln")
