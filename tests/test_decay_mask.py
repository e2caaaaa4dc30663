"""`--weight-decay` spares biases and normalisation scales by what they are (issue 51).

Under `nn.scan` every per-layer bias and scale gains a layer axis, so a
rule by number of dimensions decayed them all; the mask reads Flax's names.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax import optimizers

LAYERS, D = 3, 8


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _=None):
    y = nn.Dense(D)(nn.LayerNorm()(x))
    return x + nn.Dense(D)(nn.relu(nn.RMSNorm()(y))), None


class Unscanned(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(16, D)(tokens)
    for i in range(LAYERS):
      x, _ = Block(name=f"layer{i}")(x)
    return nn.Dense(16)(nn.LayerNorm()(x))


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(16, D)(tokens)
    stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=LAYERS)
    x, _ = stack(name="layers")(x, None)
    return nn.Dense(16)(nn.LayerNorm()(x))


def _params(module):
  return module.init(jax.random.key(0), jnp.zeros((2, 4), jnp.int32))["params"]


def _decayed(params, layer_prefix):
  """{path with the layer's name or axis dropped: decays} of every leaf."""
  flat = jax.tree_util.tree_leaves_with_path(optimizers.decay_mask(params))
  return {tuple("layer" if k.key.startswith(layer_prefix) else k.key for k in path): flag
          for path, flag in flat}


def test_a_scanned_model_decays_exactly_what_its_unscanned_twin_decays():
  scanned, unscanned = _params(Scanned()), _params(Unscanned())
  assert scanned["layers"]["Dense_0"]["bias"].shape == (LAYERS, D)  # The layer axis.
  by_kind = _decayed(unscanned, "layer")
  assert by_kind == _decayed(scanned, "layers")
  assert {p[-1] for p, flag in by_kind.items() if flag} == {"kernel", "embedding"}
  assert {p[-1] for p, flag in by_kind.items() if not flag} == {"bias", "scale"}


@pytest.mark.parametrize("name", ["adamw", "sgd", "momentum"])
def test_weight_decay_alone_leaves_a_scanned_models_biases_and_scales_untouched(name):
  params = jax.tree.map(lambda p: p + 1.0, _params(Scanned()))  # No zero weight hides a decay.
  lr, decay = 0.1, 0.5
  opt = optimizers.make(name, lr, weight_decay=decay)
  moved, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
  for (path, step), weight in zip(jax.tree_util.tree_leaves_with_path(moved),
                                  jax.tree.leaves(params), strict=True):
    kind = path[-1].key
    want = -lr * decay * weight if kind in ("kernel", "embedding") else np.zeros_like(weight)
    np.testing.assert_allclose(step, want, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_leaves_of_other_names_decay_by_their_dimensions():
  """Hand-written parameters keep the rule the Flax examples use: matrices decay."""
  mask = optimizers.decay_mask({"w1": jnp.ones((4, 3)), "b1": jnp.ones(3), "scale": jnp.ones((2, 3)),
                                "embedding": jnp.ones((5, 3))})
  assert mask == {"w1": True, "b1": False, "scale": False, "embedding": True}
