"""What a step carries and sums: the train state, one device's sums and their packed row."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.step import packing
from hetjax.step import precision as precision_lib
from hetjax.mesh import Meshes
from hetjax.task import Task

PyTree = Any


class TrainState(NamedTuple):
  """Everything the optimizer carries: replicated on this host's devices while
  training (`to_local_tree`), as global replicated arrays where every host
  holds one (`init_state`, checkpoints, `Trainer.state`)."""

  step: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree
  loss_scale: precision_lib.LossScale  # (1, 0) unless fp16 scales its loss


class Sums(NamedTuple):
  """What one device sums over its micro-batches (packed into one float32 row)."""

  grads: PyTree
  weight: jax.Array     # the normaliser: real examples, or their `Weighted` weights
  count: jax.Array      # real examples
  loss: jax.Array
  metrics: dict[str, jax.Array]
  model_state: PyTree   # sum of count-weighted new model states (BatchNorm)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one device's sums travel: a row `[sums | loss scale | host vector]`, its `Sums` packed
  into `row_size` float32s (summed over devices), then the scale and `k` values (set)."""

  sums: packing.Packer
  precision: str

  @property
  def row_size(self) -> int:
    return self.sums.sizes.get("float32", 0)


@jax.tree_util.register_pytree_node_class
class LocalSums:
  """The local program's output: one `[local devices, row + 1 + k]` float32 array (`Layout`)."""

  def __init__(self, flat: jax.Array, layout: Layout):
    self.flat, self.layout = flat, layout

  def tree_flatten(self):
    return (self.flat,), (self.layout,)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def totals(self) -> Sums:
    """This host's sums, unpacked (summed over its devices): for tests and tools."""
    n = self.layout.row_size
    return self.layout.sums.unpack({"float32": jnp.sum(self.flat[:, :n], axis=0)})

  def host_values(self) -> np.ndarray:
    """The host vector the sums carry (read from the first device): for tests and tools."""
    return np.asarray(self.flat.addressable_data(0))[0, self.layout.row_size + 1:]


def init_state(task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               example_batch: dict[str, np.ndarray], seed: int,
               precision: str = "fp32") -> TrainState:
  """Initialises the train state as global replicated arrays (same on every host)."""

  def init(seed, batch):
    params, model_state = task.init(jax.random.key(seed), batch)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state,
                      precision_lib.initial_scale(precision))

  return jax.jit(init, out_shardings=meshes.replicated)(np.int32(seed), example_batch)
