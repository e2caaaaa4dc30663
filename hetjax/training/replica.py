"""This host's replica of the train state: the live arrays, the update not yet applied, the views lent out.

The last step's update waits, "pending", for the next program (or a read) to
apply it: on one device the next local program runs it; in a larger world the
reduction updated each slice once and the next program unpacks the result.
Buffers lent to a user are never donated: the next step donates a copy.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax import mesh as mesh_lib
from hetjax import optimizers as optimizers_lib
from hetjax import step as step_lib
from hetjax.step import sharding as sharding_lib

# One program for the whole tree: copied op by op, each leaf shape would compile its own.
_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class Replica:
  """The train state of one host, with its pending update and its cached whole / global views.

  `live` holds parameters, model state, step and loss scale (and, on one
  device, the optimizer state); under the sharded update the optimizer
  state lives split in `shards`.
  """

  def __init__(self, local: step_lib.LocalProgram, meshes: mesh_lib.Meshes,
               sharded: sharding_lib.ShardedUpdate | None, shows_learning_rate: bool):
    self.local, self.meshes, self.sharded = local, meshes, sharded
    self.shows_learning_rate = shows_learning_rate
    self.live: step_lib.TrainState
    self.pending: tuple[int | None, jax.Array] | None = None  # (step, its summed row) not yet applied
    self.shards: sharding_lib.Shards | None = None
    self._global: tuple[step_lib.TrainState, step_lib.TrainState] | None = None
    self._whole: tuple[step_lib.TrainState, step_lib.TrainState] | None = None
    self._lent: step_lib.TrainState | None = None
    self.late_lr: dict[int, jax.Array] = {}  # step -> its update's learning rate, not yet read
    self._memory: dict[str, Any] | None = None

  def replace(self, state: step_lib.TrainState) -> None:
    """Takes `state` (global replicated arrays) as this host's replica."""
    live, pending = mesh_lib.to_local_tree(state, self.meshes), None
    if self.sharded is not None:
      self.shards = self.sharded.split(state)
      live = live._replace(opt_state=None)
      # Each device initialised (or restored) its own copy; the replicas take
      # each slice from the one device that holds it, as after every update.
      pending = (None, self.sharded.replica(self.shards, self.meshes))
    self.live, self.pending, self._global, self._whole = live, pending, None, None

  def lend(self, view: Any) -> Any:
    """`view` of the live buffers goes to a user: the next step donates a copy of them."""
    self._lent = self.live
    return view

  def apply_pending(self) -> None:
    """Applies the last step's update alone, if it still waits for a program."""
    if self.pending is not None:
      step, total = self.pending
      self.live, lr = self.local.update(self.live, total)
      self.pending = None
      if self.shows_learning_rate and lr is not None:
        self.late_lr[step] = lr

  def applied(self) -> step_lib.TrainState:
    """This host's replica, every update applied; under the sharded update without
    its optimizer state (parameters, model state, step, loss scale)."""
    self.apply_pending()
    return self.local.joined(self.live)  # Whole parameters, under within-host sharding too.

  def settled(self) -> step_lib.TrainState:
    """The replica whole, for reads that keep nothing past the next step: under the sharded
    update the optimizer state is gathered (cached per step), so checkpoints keep the unsplit
    layout and resume on any number of hosts and devices (invariant 5)."""
    live = self.applied()
    if self.sharded is None:
      return live
    if self._whole is None or self._whole[0] is not live:
      self._whole = (live, live._replace(opt_state=self.sharded.local_opt_state(
          self.shards, self.meshes)))
    return self._whole[1]

  def global_view(self) -> step_lib.TrainState:
    """`settled` as global replicated arrays (orbax, the job's description); cached per step."""
    whole = self.settled()
    if self._global is None or self._global[0] is not whole:
      self._global = (whole, mesh_lib.to_global_tree(whole, self.meshes))
    return self._global[1]

  def take(self) -> tuple[step_lib.TrainState, int | None, jax.Array | None]:
    """(state to donate, step of the pending update, its summed row) for the next local program."""
    applied, pending = self.pending or (None, None)
    if self._lent is self.live:
      self.live = _copy_tree(self.live)  # Donated by the program; the lent one stays.
    self._lent = None
    return self.live, applied, pending

  def stepped(self, local: step_lib.Local, applied: int | None) -> None:
    """Keeps the local program's new state; the update it applied showed its learning rate."""
    self.live, self.pending = local.state, None
    if applied is not None and self.shows_learning_rate and local.learning_rate is not None:
      self.late_lr[applied] = local.learning_rate

  def reduced(self, step: int, reduced: step_lib.Reduced) -> None:
    """The reduction's result waits as the pending update (its slices updated, when sharded)."""
    if self.sharded is not None:  # The update ran in the reduction: its learning rate is known.
      self.shards = reduced.shards
      if self.shows_learning_rate:
        self.late_lr[step] = reduced.learning_rate
    self.pending = (step, reduced.total)

  def learning_rates(self, before: int | None = None) -> dict[int, float]:
    """The learning rates of the applied updates of steps before `before`, read once (an
    update runs in the next step's program; called when those are done: no wait)."""
    due = [s for s in self.late_lr if before is None or s < before]
    if not due:
      return {}
    values = jax.device_get([self.late_lr.pop(s) for s in due])
    return {s: float(lr) for s, lr in zip(due, values)}

  def learning_rate(self) -> float | None:
    """The learning rate of the last update, None for an optimizer that hides it."""
    self.apply_pending()
    opt_state = self.live.opt_state if self.sharded is None else self.shards.opt_state
    lr = optimizers_lib.find_learning_rate(opt_state)  # A scalar: replicated, never split.
    return None if lr is None else float(np.asarray(lr.addressable_data(0)))

  def block_until_ready(self) -> None:
    """Waits for every dispatched program, without applying the pending update."""
    jax.block_until_ready((self.live, self.pending, self.shards))

  def memory_per_device(self, reduction: str,
                        optimizer: optax.GradientTransformation) -> dict[str, Any]:
    """`Trainer.memory_per_device`; shapes are fixed for the run, so computed once."""
    if self._memory is None:
      if self.sharded is None:
        self._memory = {"split_over": 1, "where": "devices",
                        **sharding_lib.memory_per_device(self.live, 1)}
      else:
        where = "devices" if reduction == "device" else "host CPUs (one per host)"
        self._memory = {"split_over": self.sharded.size, "where": where,
                        "update_layout": self.sharded.layout,
                        **sharding_lib.memory_per_device(self.sharded.like, self.sharded.size,
                                                         optimizer, self.sharded.layout)}
    return self._memory
