"""Which layout the sharded update gives an optimizer, decided before anything compiles.

`hetjax.step.elementwise` reads the optimizer's traced program: only
element-wise operations, and reductions of gradients that are zero at the
padding, may skip the numeric probe. Every case here is checked against
what the probe (which runs the optimizer on both layouts) concludes, so a
reading that calls an optimizer element-wise when it is not fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from hetjax.step import elementwise, optimizer_layout

SHARDS = 4
PARAMS = {"dense": {"kernel": jax.ShapeDtypeStruct((10, 6), jnp.float32),
                    "bias": jax.ShapeDtypeStruct((6,), jnp.float32)},
          "norm": {"scale": jax.ShapeDtypeStruct((6,), jnp.float32)}}
SLICED = jax.tree.map(lambda p: jax.ShapeDtypeStruct(
    optimizer_layout.view_shape(p.shape, SHARDS), p.dtype), PARAMS)


def _transform(fn):
  """A user's stateless transformation applying `fn` to every leaf's update."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(fn, updates), state))


by_ndim = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
# (optimizer, read as element-wise from its program, the layout a run gets).
CASES = {
    "adam": (optax.adam(1e-2), True, "sliced"),
    "adamw, mask by ndim": (optax.adamw(1e-2, weight_decay=0.1, mask=by_ndim), True, "sliced"),
    "nesterov": (optax.sgd(0.1, momentum=0.9, nesterov=True), True, "sliced"),
    "clipped sgd": (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), True, "sliced"),
    "lion": (optax.lion(1e-3), True, "sliced"),
    "lamb (norms of state)": (optax.lamb(1e-2), False, "sliced"),
    "a mean over each update": (_transform(lambda u: u - jnp.mean(u)), False, "whole"),
    "a sum of update + 1": (_transform(lambda u: u * jnp.sum(u + 1.0)), False, "whole"),
    "a reduction along axis 0": (_transform(lambda u: u / jnp.sum(jnp.abs(u), axis=0)), False,
                                 "whole"),
    "scaled by shape[0]": (_transform(lambda u: u / u.shape[0]), False, "whole"),
    "adafactor": (optax.adafactor(1e-2, min_dim_size_to_factor=4), False, "whole"),
    "muon": (optax.contrib.muon(1e-2), False, "whole"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_program_reading_and_the_probe_agree(name):
  optimizer, readable, layout = CASES[name]
  assert elementwise.same_elementwise(optimizer, PARAMS, SLICED) == readable
  state = jax.eval_shape(optimizer.init, PARAMS)
  assert optimizer_layout.choose(optimizer, PARAMS, state, SHARDS).layout == layout
  if readable:  # What the reading skips, the probe confirms.
    assert optimizer_layout.probe(optimizer, PARAMS, SHARDS) is None


def test_an_optimizer_whose_first_updates_are_all_zero_gets_whole_leaves():
  """The probe proves nothing from zeros; a mean makes it probe rather than read."""
  optimizer = optax.chain(_transform(lambda u: u - jnp.mean(u)),
                          optax.sgd(optax.constant_schedule(0.0)))
  choice = optimizer_layout.choose(optimizer, PARAMS, jax.eval_shape(optimizer.init, PARAMS),
                                   SHARDS)
  assert choice.layout == "whole" and "all zero" in choice.reason


def test_sliced_is_refused_naming_the_leaf_and_the_fix():
  optimizer = _transform(lambda u: u / u.shape[0])
  with pytest.raises(ValueError, match=r"depend on the leaves' shapes \(leaf .*'auto' or 'whole'"):
    optimizer_layout.choose(optimizer, PARAMS, optax.EmptyState(), SHARDS, "sliced")
