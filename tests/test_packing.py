"""Packing a pytree into one buffer per dtype, and the loss-scale rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.step import packing, precision


def _tree():
  rng = np.random.default_rng(0)
  return {"a": {"w": rng.normal(size=(3, 4)).astype(np.float32), "n": np.arange(5, dtype=np.int32)},
          "b": rng.normal(size=(2,)).astype(np.float32), "s": np.float32(7.0),
          "h": rng.normal(size=(2, 2)).astype(jnp.bfloat16)}


def test_pack_then_unpack_is_exact_with_one_buffer_per_dtype():
  tree = _tree()
  packer = packing.Packer(tree)
  flat = jax.jit(packer.pack)(tree)
  assert {k: v.shape for k, v in flat.items()} == {
      "bfloat16": (4,), "float32": (12 + 2 + 1,), "int32": (5,)}
  back = jax.jit(packer.unpack)(flat)
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert x.dtype == y.dtype and x.shape == np.shape(y)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_batch_dims_stay_in_front_and_a_common_dtype_makes_one_buffer():
  tree = {"g": np.ones((2, 3, 4), np.float32), "c": np.arange(2, dtype=np.float32),
          "h": np.full((2, 5), 2, jnp.bfloat16)}
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
  packer = packing.Packer(like, dtype=jnp.float32)
  flat = packer.pack(tree, batch_dims=1)
  assert list(flat) == ["float32"] and flat["float32"].shape == (2, 12 + 1 + 5)
  summed = packer.unpack({"float32": flat["float32"].sum(0)})
  np.testing.assert_array_equal(summed["g"], np.full((3, 4), 2.0))
  assert summed["c"] == 1.0 and summed["h"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(summed["h"], np.float32), np.full(5, 4.0))


def test_loss_scale_halves_on_overflow_and_grows_after_a_run_of_finite_steps():
  s = precision.initial_scale("fp16")
  assert float(s.scale) == 2.0 ** 15
  s = precision.next_scale(s, jnp.bool_(True), "fp16")
  assert float(s.scale) == 2.0 ** 14 and int(s.good_steps) == 0
  s = precision.LossScale(s.scale, jnp.int32(precision.GROWTH_INTERVAL - 2))
  s = precision.next_scale(s, jnp.bool_(False), "fp16")
  assert float(s.scale) == 2.0 ** 14
  s = precision.next_scale(s, jnp.bool_(False), "fp16")
  assert float(s.scale) == 2.0 ** 15 and int(s.good_steps) == 0
  fixed = precision.initial_scale("bf16")
  assert precision.next_scale(fixed, jnp.bool_(True), "bf16") == fixed and float(fixed.scale) == 1.0


def test_unknown_precision_is_refused_with_the_choices():
  with pytest.raises(ValueError, match="unknown precision 'fp8'; choose one of fp32, bf16, fp16"):
    precision.check("fp8")
