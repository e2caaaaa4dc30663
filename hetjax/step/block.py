"""One block's math: its sums over its real examples, and how a share is cut into blocks."""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.step import precision as precision_lib
from hetjax.task import MASK, Task, split_losses
from hetjax.step.state import Sums

PyTree = Any


def padded_chunks(batch: dict[str, np.ndarray],
                  size: int) -> Iterator[tuple[dict[str, np.ndarray], int]]:
  """Cuts a batch into `size`-row chunks, the last one padded: (chunk, real rows). Padding
  repeats the first real row (a loss NaN on all-zero rows stays finite); the mask drops it."""
  n = len(next(iter(batch.values())))
  for start in range(0, n, size):
    yield pad_rows({k: v[start:start + size] for k, v in batch.items()}, size), min(size, n - start)


def pad_rows(part: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
  """`part` padded to `size` rows with copies of its first row (see `padded_chunks`)."""
  real = len(next(iter(part.values())))
  if real == size:
    return dict(part)
  return {k: np.concatenate([v, np.repeat(v[:1], size - real, axis=0)]) for k, v in part.items()}


def micro_batches(batch: dict[str, np.ndarray], size: int) -> Iterator[dict[str, np.ndarray]]:
  """Cuts a batch into `size`-row chunks with a `MASK`, the last one padded."""
  for part, real in padded_chunks(batch, size):
    part[MASK] = (np.arange(size) < real).astype(np.float32)
    yield part


def block_sums(task: Task, params: PyTree, model_state: PyTree, block: dict[str, jax.Array],
               rng: jax.Array, scale: jax.Array, precision: str,
               blocks_full: bool = False) -> Sums:
  """One block's sums over its real examples: float32 gradients, loss, metrics, state.

  The one definition, shared by the sync step and the rounds modes. `blocks_full` (fixed for a
  run): no block is part padding, so the task's `unmasked_loss` serves. Gradients come back
  float32 under bf16 / fp16; `scale` is applied and divided out only when `precision` scales
  its loss (else a pass over every gradient dividing by 1).
  """
  return _sums(task, params, model_state, block, rng, scale, precision, blocks_full, stacked=False)


def blocks_sums(task: Task, params: PyTree, model_state: PyTree, blocks: dict[str, jax.Array],
                rngs: jax.Array, scale: jax.Array, precision: str,
                blocks_full: bool = False) -> Sums:
  """The summed `block_sums` of `j` blocks stacked on a leading axis (`[j, m, ...]`, keys `[j]`).

  Each block alone under `vmap` (its BatchNorm group, key, mask, state), so the sums equal `j`
  separate `block_sums`; one backward pass, no `j` gradient trees held at once.
  """
  return _sums(task, params, model_state, blocks, rngs, scale, precision, blocks_full,
               stacked=True)


def _sums(task: Task, params: PyTree, model_state: PyTree, block: dict[str, jax.Array],
          rng: jax.Array, scale: jax.Array, precision: str, blocks_full: bool,
          stacked: bool) -> Sums:
  compute = precision_lib.compute_dtype(precision)
  low, scaled = compute != jnp.float32, precision_lib.uses_loss_scale(precision)

  one = _forward(task, blocks_full, compute)

  def total_loss(p):
    if low:
      p = precision_lib.cast_floats(p, compute)
    if stacked:
      loss, aux = jax.vmap(one, in_axes=(None, None, 0, 0))(p, model_state, block, rng)
      loss, aux = jnp.sum(loss), jax.tree.map(lambda v: jnp.sum(v, axis=0), aux)
    else:
      loss, aux = one(p, model_state, block, rng)
    return (loss * scale if scaled else loss), (loss, aux)

  (_, (loss, (weight, n, metrics, state))), grads = jax.value_and_grad(
      total_loss, has_aux=True)(params)
  unscale = (lambda g: g.astype(jnp.float32) / scale) if scaled else (
      lambda g: g.astype(jnp.float32))
  return Sums(grads=jax.tree.map(unscale, grads), weight=weight, count=n, loss=loss,
              metrics=metrics, model_state=state)


# A loss function -> {(blocks_full, compute dtype): its jitted block forward}; an entry goes
# with its loss (the forward holds only a weak reference to it).
_FORWARDS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _forward(task: Task, blocks_full: bool, compute: Any) -> Any:
  """One block's masked loss sums and aux, as a `jax.jit` made once per loss function.

  Why: every program and trainer of a task then transforms one trace of the model. As with any
  `jax.jit`, a loss reading Python state that changes is not retraced: pass such values in.
  """
  loss_fn = task.training_loss(blocks_full)
  key = (blocks_full, jnp.dtype(compute).name)
  try:
    cache = _FORWARDS.setdefault(loss_fn, {})
    loss_ref = weakref.ref(loss_fn)
  except TypeError:  # A loss without weak references: traced in each program, as before.
    cache, loss_ref = {}, lambda: loss_fn
  if key not in cache:
    cache[key] = jax.jit(_masked_sums(loss_ref, compute))
  return cache[key]


def _masked_sums(loss_ref: Any, compute: Any) -> Any:
  low = compute != jnp.float32
  masked = lambda v, real: jnp.sum(jnp.where(real, v.astype(jnp.float32), 0.0))

  def one(params, model_state, block, rng):
    real = block[MASK] > 0
    # An all-padding block shows the model an all-ones mask: masked BatchNorm over zero rows
    # is NaN, which survives `where` in the backward pass. Every sum below uses `real`.
    model_block = {**block, MASK: jnp.where(jnp.any(real), block[MASK], 1.0)}
    if low:
      model_block = precision_lib.cast_batch(model_block, compute, keep=(MASK,))
    losses, metrics, new_state = loss_ref()(params, model_state, model_block, rng)
    values, weights = split_losses(losses)
    n = jnp.sum(real.astype(jnp.float32))
    weight = masked(weights, real) if weights is not None else n
    return masked(values, real), (weight, n, {k: masked(v, real) for k, v in metrics.items()},
                                  jax.tree.map(lambda s: jnp.where(n > 0, s * n, 0.0), new_state))

  return one
