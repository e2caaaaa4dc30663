"""The update rule, one for a whole state and for its slices: summed gradients over summed
weights, the optax update, the count-weighted model state, the fp16 skip."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from hetjax import optimizers as optimizers_lib
from hetjax.step import precision as precision_lib
from hetjax.step.state import Layout, Sums, TrainState


def apply_update(optimizer: optax.GradientTransformation, state: TrainState, total: jax.Array,
                 layout: Layout) -> tuple[TrainState, jax.Array]:
  """`sum(grad sums) / sum(weights)`, the optax update, the weighted model state.

  `total`: `Reduced.total`. An fp16 overflow skips the update and halves the scale on every
  host. Also returns the learning rate (NaN when the optimizer hides it).
  """
  row = summed_row(total, layout)
  return optimizer_step(optimizer, state, layout.sums.unpack({"float32": row}),
                        overflowed(row, layout), layout)


def optimizer_step(optimizer: optax.GradientTransformation, state: Any, totals: Sums,
                   overflow: jax.Array, layout: Layout) -> tuple[Any, jax.Array]:
  """The one update rule, on a whole state or on its slices: (new state, learning rate).

  `state`: a `TrainState` or `Shards`; `totals` laid out as the state is (whole or `[S, c]`
  slices), so both paths divide, update, average and skip an fp16 overflow alike.
  """
  count = totals.count
  # count == 0 is reported by the trainer as an error; a zero total weight
  # leaves the gradient zero rather than NaN.
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  # Divided leaf by leaf, so XLA fuses each division into the optimizer's first pass.
  grads = jax.tree.map(lambda g, p: (g / norm).astype(p.dtype), totals.grads, state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  safe = jnp.maximum(count, 1.0)
  model_state = jax.tree.map(
      lambda old, s: jnp.where(count > 0, s / safe, old).astype(old.dtype),
      state.model_state, totals.model_state)
  if precision_lib.uses_loss_scale(layout.precision):
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(overflow, b, a), new, old)
    params, opt_state, model_state = keep(
        (params, opt_state, model_state), (state.params, state.opt_state, state.model_state))
  lr = optimizers_lib.find_learning_rate(opt_state)
  lr = jnp.float32(jnp.nan) if lr is None else jnp.asarray(lr, jnp.float32)
  loss_scale = precision_lib.next_scale(state.loss_scale, overflow, layout.precision)
  return state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                        model_state=model_state, loss_scale=loss_scale), lr


def summed_row(total: jax.Array, layout: Layout) -> jax.Array:
  """The `[n]` sums of a `Reduced.total` (a one-device world's is its `[1, n + 1 + k]` row)."""
  return total[0, :layout.row_size] if total.ndim == 2 else total


def overflowed(total: jax.Array, layout: Layout) -> jax.Array:
  """fp16: some sum is not finite (a host's, or the sum of all: the same step skipped
  everywhere); always False when the loss is not scaled."""
  if not precision_lib.uses_loss_scale(layout.precision):
    return jnp.bool_(False)
  return ~jnp.all(jnp.isfinite(total))


def step_stats(total: jax.Array, scale: jax.Array, layout: Layout) -> dict[str, jax.Array]:
  """A step's global statistics from `total` and the loss scale it ran with."""
  return stats_of(layout.sums.unpack({"float32": total}), overflowed(total, layout), scale, layout)


def stats_of(totals: Sums, overflow: jax.Array, scale: jax.Array, layout: Layout
             ) -> dict[str, jax.Array]:
  """`step_stats` from the summed scalars (`totals`' loss, weight, count, metrics)."""
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  stats = {"count": totals.count, "loss": totals.loss / norm}
  stats.update({k: v / norm for k, v in totals.metrics.items()})
  if precision_lib.uses_loss_scale(layout.precision):
    stats.update(loss_scale=scale, skipped=overflow.astype(jnp.float32))
  return stats


def stat_names(layout: Layout) -> tuple[str, ...]:
  """The names of `step_stats`, in the order a `Reduced.report` holds them."""
  total = jax.ShapeDtypeStruct((layout.row_size,), jnp.float32)
  return tuple(jax.eval_shape(lambda t: step_stats(t, jnp.float32(1.0), layout), total))
