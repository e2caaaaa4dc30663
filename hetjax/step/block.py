"""One block's math: its sums over its real examples, and how a share is cut into blocks."""

from __future__ import annotations

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
  """Cuts a batch into `size`-row chunks, the last one padded: (chunk, real rows).

  Padding rows repeat the chunk's first (real) row: a loss that is NaN on an
  all-zero row (a count of zero tokens, say) stays finite, and the mask
  removes the copies from every sum with `where`.
  """
  n = len(next(iter(batch.values())))
  for start in range(0, n, size):
    part = {k: v[start:start + size] for k, v in batch.items()}
    real = min(size, n - start)
    if real < size:
      part = {k: np.concatenate([v, np.repeat(v[:1], size - real, axis=0)])
              for k, v in part.items()}
    yield part, real


def micro_batches(batch: dict[str, np.ndarray], size: int) -> Iterator[dict[str, np.ndarray]]:
  """Cuts a batch into `size`-row chunks with a `MASK`, the last one padded."""
  for part, real in padded_chunks(batch, size):
    part[MASK] = (np.arange(size) < real).astype(np.float32)
    yield part


def block_sums(task: Task, params: PyTree, model_state: PyTree, block: dict[str, jax.Array],
               rng: jax.Array, scale: jax.Array, precision: str,
               blocks_full: bool = False) -> Sums:
  """One block's sums over its real examples: float32 gradients, loss, metrics, state.

  The one definition of what a device computes for a block, shared by the
  sync step and the rounds modes' local steps. `blocks_full` (fixed for a
  run): every block is all real or all padding, never partly; then the
  task's `unmasked_loss` serves, as the sums drop an all-padding block
  whole. Under bf16 / fp16 the model
  runs in the low type from float32 parameters, so the gradients come back
  float32; `scale` multiplies the loss before differentiation and is divided
  out of the gradients, only when `precision` scales its loss (a pass over
  every gradient otherwise spent dividing by 1).
  """
  compute = precision_lib.compute_dtype(precision)
  low, scaled = compute != jnp.float32, precision_lib.uses_loss_scale(precision)
  real = block[MASK] > 0
  masked_sum = lambda v: jnp.sum(jnp.where(real, v.astype(jnp.float32), 0.0))
  # An all-padding block (a host whose blocks do not fill its last device
  # round) shows the model an all-ones mask: masked BatchNorm over zero rows
  # would be NaN, and NaN survives `where` in the backward pass. Its rows are
  # copies of a real row, and every sum below uses `real`.
  model_block = {**block, MASK: jnp.where(jnp.any(real), block[MASK], 1.0)}
  loss_fn = task.training_loss(blocks_full)
  if low:
    model_block = precision_lib.cast_batch(model_block, compute, keep=(MASK,))

  def total_loss(p):
    if low:
      p = precision_lib.cast_floats(p, compute)
    losses, metrics, new_state = loss_fn(p, model_state, model_block, rng)
    values, weights = split_losses(losses)
    weight = masked_sum(weights) if weights is not None else jnp.sum(real.astype(jnp.float32))
    loss = masked_sum(values)
    return (loss * scale if scaled else loss), (loss, metrics, new_state, weight)

  (_, (loss, metrics, new_state, weight)), grads = jax.value_and_grad(
      total_loss, has_aux=True)(params)
  n = jnp.sum(real.astype(jnp.float32))
  unscale = (lambda g: g.astype(jnp.float32) / scale) if scaled else (
      lambda g: g.astype(jnp.float32))
  return Sums(grads=jax.tree.map(unscale, grads), weight=weight, count=n, loss=loss,
              metrics={k: masked_sum(v) for k, v in metrics.items()},
              model_state=jax.tree.map(lambda s: jnp.where(n > 0, s * n, 0.0), new_state))
