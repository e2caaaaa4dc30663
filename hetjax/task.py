"""What hetjax needs from a model: an init and a per-example loss.

The step never sees a Flax module; it sees a `Task`. Per-example losses (not a
mean) are the whole trick: the step multiplies them by the padding mask and
sums, so hosts with different batch sizes can be reconciled exactly by
`sum(grad sums) / sum(counts)`.

A batch is a dict of arrays with a common leading dimension. The step adds a
float32 `"mask"` entry (1 for a real example, 0 for padding); a model may use
it (BatchNorm statistics must ignore padding) or leave it alone.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

PyTree = Any
Batch = dict[str, jax.Array]
# (losses [b], metrics {name: [b]}, new model state)
LossOutput = tuple[jax.Array, dict[str, jax.Array], PyTree]


@dataclasses.dataclass(frozen=True)
class Task:
  """A model as hetjax trains it.

  Attributes:
    init: `init(rng, example_batch) -> (params, model_state)`. `model_state`
      holds non-trained variables such as BatchNorm running statistics (an
      empty dict when there are none).
    loss: `loss(params, model_state, batch, rng) -> (losses, metrics,
      new_model_state)` with `losses` of shape `[b]` and every metric of shape
      `[b]` (per example; hetjax sums them over the real examples).
    eval_loss: the same contract in inference mode (BatchNorm running
      averages); `None` when it equals `loss`.
  """

  init: Callable[[jax.Array, Batch], tuple[PyTree, PyTree]]
  loss: Callable[[PyTree, PyTree, Batch, jax.Array], LossOutput]
  eval_loss: Callable[[PyTree, PyTree, Batch, jax.Array], LossOutput] | None = None

  def evaluation_loss(self) -> Callable[[PyTree, PyTree, Batch, jax.Array], LossOutput]:
    """The loss to evaluate with: `eval_loss` when given, else `loss`."""
    return self.eval_loss or self.loss


def from_functions(
    init: Callable[[jax.Array, Batch], PyTree],
    per_example_loss: Callable[[PyTree, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]],
) -> Task:
  """Builds a stateless `Task` from plain functions.

  Args:
    init: `init(rng, example_batch) -> params`.
    per_example_loss: `per_example_loss(params, batch, rng) -> (losses[b],
      metrics)`, metrics a dict of `[b]` arrays (may be empty).

  Example:
    >>> task = from_functions(lambda rng, b: {"w": jnp.zeros(3)},
    ...     lambda p, b, rng: (((b["x"] @ p["w"]) - b["y"]) ** 2, {}))
  """

  def _init(rng, batch):
    return init(rng, batch), {}

  def _loss(params, state, batch, rng):
    losses, metrics = per_example_loss(params, batch, rng)
    return losses, dict(metrics), state

  return Task(_init, _loss)


def _accepts(fn: Callable, name: str) -> bool:
  try:
    return name in inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False


def from_linen(
    module: Any,
    per_example_loss: Callable[[jax.Array, Batch], tuple[jax.Array, dict[str, jax.Array]]],
    *,
    input_key: str = "x",
) -> Task:
  """Wraps a Flax linen module.

  The module is called as `module(batch[input_key], train=..., mask=...)`;
  `train` and `mask` are passed only if its `__call__` names them. Variables
  in the `batch_stats` collection become the model state.

  Args:
    module: a `flax.linen.Module`.
    per_example_loss: `per_example_loss(outputs, batch) -> (losses[b],
      metrics)`.
    input_key: which batch entry feeds the module.
  """
  takes_train = _accepts(module.__call__, "train")
  takes_mask = _accepts(module.__call__, "mask")

  def kwargs(batch, train):
    kw = {}
    if takes_train:
      kw["train"] = train
    if takes_mask and train:
      kw["mask"] = batch.get("mask")
    return kw

  def init(rng, batch):
    params_rng, dropout_rng = jax.random.split(rng)
    variables = module.init(
        {"params": params_rng, "dropout": dropout_rng},
        batch[input_key], **kwargs(batch, False))
    variables = dict(variables)
    params = variables.pop("params")
    return params, variables

  def make_loss(train):
    def loss(params, state, batch, rng):
      mutable = list(state) if (train and state) else False
      outputs = module.apply(
          {"params": params, **state}, batch[input_key],
          rngs={"dropout": rng}, mutable=mutable, **kwargs(batch, train))
      if mutable:
        outputs, new_state = outputs
        new_state = {**state, **new_state}
      else:
        new_state = state
      losses, metrics = per_example_loss(outputs, batch)
      return losses, dict(metrics), new_state
    return loss

  return Task(init, make_loss(True), make_loss(False))


def from_nnx(
    model: Any,
    per_example_loss: Callable[[jax.Array, Batch], tuple[jax.Array, dict[str, jax.Array]]],
    *,
    input_key: str = "x",
) -> Task:
  """Wraps a Flax NNX module that the caller has already built.

  NNX modules initialise eagerly from their own `nnx.Rngs`, so `init` ignores
  its rng and returns the module's current parameters. `nnx.Param` variables
  are trained; every other variable (BatchNorm statistics) is model state.
  The module is called as `model(batch[input_key])` in train mode.
  """
  from flax import nnx  # Only NNX users pay for the import.

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

  def init(rng, batch):
    del rng, batch
    return jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, rest)

  def loss(p, state, batch, rng):
    del rng
    _, abstract_params, abstract_rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(abstract_params, p)
    nnx.replace_by_pure_dict(abstract_rest, state)
    m = nnx.merge(graphdef, abstract_params, abstract_rest)
    m.train()
    outputs = m(batch[input_key])
    new_state = nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param)))
    losses, metrics = per_example_loss(outputs, batch)
    return losses, dict(metrics), new_state

  return Task(init, loss)
