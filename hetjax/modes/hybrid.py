"""How a round of hybrid works (local SGD across hosts, data parallel inside a host).

Round r, on every host i:
1. start from the centre `theta` (the parameters every host agrees on) and
   the host's own inner optimizer state, which stays on the host;
2. run `tau_i` local steps of `b` samples, reaching `theta_i`;
3. one reduction of `[n_i * (theta - theta_i), n_i * model_state_i]`, with
   `n_i = tau_i * b` the samples the host processed;
4. the outer gradient `sum n_i delta_i / sum n_i` (sample-weighted: the
   FedNova-consistent form when every host reads one global stream) goes
   through the outer optax optimizer, each slice of the centre on one
   device, then gathered (invariant 6). The outer optimizer state is kept
   whole on every device (it is saved with the centre).

With one local step per host, plain SGD inside and outer SGD with lr 1, a
round is exactly a sync step over the same positions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from hetjax import mesh as mesh_lib
from hetjax.config import RoundsConfig
from hetjax.step import sharding as sharding_lib
from hetjax.modes import rounds as rounds_lib
from hetjax.modes.rounds_mode import Rounds
from hetjax.mesh import Meshes

PyTree = Any


def outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
  """'sgd' (momentum optional) or 'nesterov' (DiLoCo's outer optimizer)."""
  if name == "nesterov":
    return optax.sgd(lr, momentum=momentum, nesterov=True)
  return optax.sgd(lr, momentum=momentum or None)


class Centre(NamedTuple):
  """What every host agrees on, as global replicated arrays (also what is saved)."""

  round: jax.Array
  params: PyTree
  opt_state: PyTree     # the outer optimizer's
  model_state: PyTree


class Hybrid(Rounds):
  """Hybrid: local SGD across hosts, an outer optimizer on the hosts' sample-weighted deltas.

  Example:
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer = hetjax.Trainer(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                          hetjax.TrainConfig(global_batch=32, microbatch=8),
    ...                          mode=hetjax.Hybrid(round_steps=4))
    >>> trainer.fit(steps=2)["mode"]   # 2 rounds
    'hybrid'
  """

  def __init__(self, round_steps: int = 4, local_steps: tuple[int, ...] | None = None,
               local_batch: int | None = None, outer_optimizer: str = "nesterov",
               outer_lr: float = 0.7, outer_momentum: float = 0.9):
    """Args (`hetjax.config.RoundsConfig` says more of each):
      round_steps: local steps of the fastest host per round (the others from their speeds).
      local_steps: fixed local steps per host instead (reproducible), e.g. (4, 2, 1).
      local_batch: samples of one local step of one host (default: global batch / hosts).
      outer_optimizer, outer_lr, outer_momentum: the outer optax optimizer, 'sgd' or
        'nesterov' (DiLoCo's 0.7 and 0.9 by default; momentum 0: plain SGD).
    """
    super().__init__(RoundsConfig("hybrid", round_steps, local_steps, local_batch,
                                  outer_optimizer, outer_lr, outer_momentum))

  def compile(self, meshes: Meshes, outer: optax.GradientTransformation | None = None,
              backend: str = "device") -> None:
    """The round's programs on `meshes`, the outer update where `backend` reduces
    (`outer`: the outer optimizer, default the settings')."""
    s = self.settings
    outer = outer or outer_optimizer(s.outer_optimizer, s.outer_lr, s.outer_momentum)
    self.meshes = meshes

    def init(params, model_state):
      return Centre(jnp.zeros((), jnp.int32), params, outer.init(params), model_state)

    self._init = jax.jit(init, out_shardings=meshes.replicated)

    def contribution(centre_params, params, model_state, n):
      delta = jax.tree.map(lambda c, p: n * (c - p).astype(jnp.float32), centre_params, params)
      return {"delta": delta, "model_state": jax.tree.map(lambda s: n * s, model_state)}

    self._contribution = jax.jit(contribution, out_shardings=meshes.local_replicated)

    def make_finish(mesh, axis):
      def finish(centre, totals, total_n):  # Its name names the compiled program (test_host_values).
        return self._outer_step(outer, mesh, axis, centre, totals, total_n)
      return finish

    self._finish = rounds_lib.OuterUpdate(make_finish, backend, meshes)

  @staticmethod
  def _outer_step(outer: optax.GradientTransformation, mesh: Mesh, axis: str, centre: Centre,
                  totals: dict, total_n: jax.Array) -> Centre:
    """The outer optimizer's step on the centre, each slice by one device of `mesh` (traced)."""
    keep = sharding_lib.scalar_leaves(outer, centre.params, centre.opt_state, mesh.devices.size)
    split = lambda tree, keep=None: sharding_lib.split_tree(tree, mesh, axis, keep)
    params = split(centre.params)
    grads = jax.tree.map(lambda d, p: (d / total_n).astype(p.dtype), split(totals["delta"]),
                         params)
    updates, opt_state = outer.update(grads, split(centre.opt_state, keep), params)
    params = optax.apply_updates(params, updates)
    model_state = jax.tree.map(lambda s, old: (s / total_n).astype(old.dtype),
                               split(totals["model_state"]), split(centre.model_state))
    gather = lambda tree, like, keep=None: sharding_lib.gather_tree(tree, like, mesh, axis, keep)
    return Centre(centre.round + 1, gather(params, centre.params),
                  gather(opt_state, centre.opt_state, keep),
                  gather(model_state, centre.model_state))

  def start(self, centre: Centre, host_params: PyTree, host_model_state: PyTree
            ) -> tuple[PyTree, PyTree]:
    """Every round starts from the centre (the inner optimizer state is kept)."""
    del host_params, host_model_state
    return rounds_lib.to_host_mesh((centre.params, centre.model_state), self.meshes)

  def contribution(self, centre: Centre, params: PyTree, model_state: PyTree, n: int,
                   total_n: int) -> dict:
    """`[n_i * delta_i, n_i * model_state_i]` on this host's devices."""
    del total_n
    centre_params = mesh_lib.to_local_tree(centre.params, self.meshes)
    return self._contribution(centre_params, params, model_state, jnp.float32(n))

  def spread(self, mine: dict, totals: dict, n: int, total_n: int) -> jax.Array:
    """`||theta_i - mean||`: `delta_i - sum n_j delta_j / sum n` (the mean is sample-weighted)."""
    return rounds_lib.spread(mine["delta"], n, totals["delta"], total_n, self.meshes)

  def finish(self, centre: Centre, totals: dict, params: PyTree, total_n: int
             ) -> tuple[Centre, PyTree]:
    """The outer update (identical on every host); the host's parameters restart next round."""
    return self._finish(centre, totals, jnp.float32(total_n)), params
