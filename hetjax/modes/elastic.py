"""How a round of elastic averaging works (EASGD with synchronous rounds).

Each host keeps its own parameters `x_i` (and inner optimizer state) across
rounds; the centre is replicated on every host. Round r, on host i:
1. run `tau_i` local steps of `b` samples from `x_i`;
2. `d_i = alpha_i (x_i - centre)`, `alpha_i = beta * n_i / sum n` with
   `n_i = tau_i * b` (every host knows every `n` before the round starts);
3. one reduction of `[d_i, n_i * model_state_i]`; `x_i -= d_i`,
   `centre += sum_i d_i`.
The centre is what is evaluated, checkpointed and reported; its model state
(BatchNorm statistics) is the sample-weighted mean of the hosts'.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from hetjax import mesh as mesh_lib
from hetjax.step import sharding as sharding_lib
from hetjax.modes import rounds as rounds_lib
from hetjax.modes.hybrid import Centre
from hetjax.mesh import Meshes

PyTree = Any


class Elastic:
  name = "elastic"

  def __init__(self, beta: float, meshes: Meshes):
    self.beta, self.meshes = float(beta), meshes
    self._init = jax.jit(lambda p, s: Centre(jnp.zeros((), jnp.int32), p, (), s),
                         out_shardings=meshes.replicated)

    def contribution(centre_params, params, model_state, n, alpha):
      d = jax.tree.map(lambda x, c: alpha * (x - c).astype(jnp.float32), params, centre_params)
      return {"d": d, "model_state": jax.tree.map(lambda s: n * s, model_state)}

    self._contribution = jax.jit(contribution, out_shardings=meshes.local_replicated)
    self._pull = jax.jit(lambda params, d: jax.tree.map(lambda x, v: (x - v).astype(x.dtype), params, d),
                         out_shardings=meshes.local_replicated, donate_argnums=(0,))

    world, axis = meshes.world, mesh_lib.ALL

    def finish(centre, totals, total_n):
      # Each slice of the centre computed by one device, then gathered
      # (`hetjax.step.sharding`), as the sync step's update.
      split = lambda tree: sharding_lib.split_tree(tree, world, axis)
      params = jax.tree.map(lambda c, v: (c + v).astype(c.dtype), split(centre.params),
                            split(totals["d"]))
      model_state = jax.tree.map(lambda s, old: (s / total_n).astype(old.dtype),
                                 split(totals["model_state"]), split(centre.model_state))
      gather = lambda tree, like: sharding_lib.gather_tree(tree, like, world, axis)
      return Centre(centre.round + 1, gather(params, centre.params), (),
                    gather(model_state, centre.model_state))

    self._finish = jax.jit(finish, out_shardings=meshes.replicated, donate_argnums=(0,))
    self._last_d = None

  def init_centre(self, params: PyTree, model_state: PyTree) -> Centre:
    return self._init(params, model_state)

  def start(self, centre: Centre, host_params: PyTree, host_model_state: PyTree
            ) -> tuple[PyTree, PyTree]:
    """A host keeps its own parameters; the first round starts them at the centre."""
    if host_params is None:
      local = lambda t: jax.tree.map(lambda x: jnp.copy(mesh_lib.to_local(x, self.meshes)), t)
      return local(centre.params), local(centre.model_state)
    return host_params, host_model_state

  def alpha(self, n: int, total_n: int) -> float:
    return self.beta * n / total_n

  def contribution(self, centre: Centre, params: PyTree, model_state: PyTree, n: int,
                   total_n: int) -> dict:
    """`[d_i, n_i * model_state_i]` on this host's devices."""
    centre_params = jax.tree.map(lambda x: mesh_lib.to_local(x, self.meshes), centre.params)
    alpha = jnp.float32(self.alpha(n, total_n))
    tree = self._contribution(centre_params, params, model_state, jnp.float32(n), alpha)
    self._last_d = tree["d"]
    return tree

  def spread(self, mine: dict, totals: dict, n: int, total_n: int) -> jax.Array:
    """`||x_i - mean||` before the pull: `d_i / alpha_i - sum d / beta`.

    `sum_j d_j = beta (mean - centre)` with the sample-weighted mean of the hosts.
    """
    return rounds_lib.spread(mine["d"], self.alpha(n, total_n), totals["d"], self.beta,
                             self.meshes)

  def finish(self, centre: Centre, totals: dict, params: PyTree, total_n: int
             ) -> tuple[Centre, PyTree]:
    """`centre += sum d`, `x_i -= d_i`."""
    params = self._pull(params, self._last_d)
    self._last_d = None
    return self._finish(centre, totals, jnp.float32(total_n)), params
