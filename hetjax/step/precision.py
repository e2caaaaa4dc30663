"""Mixed precision: compute in bf16 or fp16, keep float32 where sums happen.

Parameters stay float32 masters, cast (with the batch's float inputs) before the forward pass,
so gradients, sums and the reduction stay float32 (16-bit sums over thousands of examples would
lose the small ones). fp16's loss is scaled dynamically: on any host's overflow every host skips
the update and halves the scale; `GROWTH_INTERVAL` finite steps in a row double it. The decision
uses only values the reduction gives every host (invariant 3).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hetjax.config import PRECISIONS, check_choice

PyTree = Any
_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
INITIAL_SCALE = 2.0 ** 15
GROWTH_INTERVAL = 2000   # finite steps before the scale doubles
MAX_SCALE = 2.0 ** 24


def check(precision: str) -> str:
  """Returns `precision` or raises naming the choices."""
  check_choice("precision", precision, PRECISIONS)
  return precision


def compute_dtype(precision: str) -> Any:
  return _DTYPES[check(precision)]


def uses_loss_scale(precision: str) -> bool:
  return check(precision) == "fp16"


def cast_floats(tree: PyTree, dtype: Any) -> PyTree:
  """Floating leaves to `dtype`; integer leaves (labels, tokens) unchanged."""
  def cast(x):
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, tree)


def cast_batch(batch: dict[str, jax.Array], dtype: Any, keep: tuple[str, ...] = ("mask",)) -> dict:
  """The batch's floating inputs in the compute type; `keep` entries untouched."""
  return {k: (v if k in keep else cast_floats(v, dtype)) for k, v in batch.items()}


class LossScale(NamedTuple):
  """The dynamic loss scale, part of the train state (saved in checkpoints)."""

  scale: jax.Array       # float32 scalar; 1 when no scaling is used
  good_steps: jax.Array  # int32 scalar: finite steps since the last change


def initial_scale(precision: str) -> LossScale:
  scale = INITIAL_SCALE if uses_loss_scale(precision) else 1.0
  return LossScale(jnp.float32(scale), jnp.int32(0))


def next_scale(state: LossScale, overflow: jax.Array, precision: str) -> LossScale:
  """Halves on overflow, doubles after `GROWTH_INTERVAL` finite steps; fixed if unused."""
  if not uses_loss_scale(precision):
    return state
  grown = state.good_steps + 1 >= GROWTH_INTERVAL
  scale = jnp.where(overflow, jnp.maximum(state.scale / 2, 1.0),
                    jnp.where(grown, jnp.minimum(state.scale * 2, MAX_SCALE), state.scale))
  good = jnp.where(overflow | grown, 0, state.good_steps + 1)
  return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32))
