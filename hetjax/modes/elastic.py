"""How a round of elastic averaging works (EASGD with synchronous rounds).

Each host keeps its own parameters `x_i` (and inner state); the centre is
replicated. Round r, on host i:
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
from hetjax.config import RoundsConfig
from hetjax.step import sharding as sharding_lib
from hetjax.modes import rounds as rounds_lib
from hetjax.modes.hybrid import Centre
from hetjax.modes.rounds_mode import Rounds
from hetjax.mesh import Meshes

PyTree = Any


class Elastic(Rounds):
  """Elastic averaging (EASGD): each host keeps its own parameters, pulled towards a centre.

  Example:
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer = hetjax.Trainer(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                          hetjax.TrainConfig(global_batch=32, microbatch=8),
    ...                          mode=hetjax.Elastic(beta=0.5, local_steps=(2,)))
    >>> trainer.fit(steps=2)["per_host"][0]["tau"]   # 2 rounds of 2 local steps
    [2, 2]
  """

  def __init__(self, beta: float = 0.9, round_steps: int = 4,
               local_steps: tuple[int, ...] | None = None, local_batch: int | None = None):
    """Args:
      beta: the moving rate: host i moves `beta * n_i / sum n` of the way to the centre
        each round, in (0, 1].
      round_steps, local_steps, local_batch: as for `hetjax.Hybrid`.
    """
    super().__init__(RoundsConfig("elastic", round_steps, local_steps, local_batch,
                                  elastic_beta=beta))
    self.beta = float(beta)

  def compile(self, meshes: Meshes, backend: str = "device") -> None:
    """The round's programs on `meshes`, the centre's move where `backend` reduces."""
    self.meshes = meshes
    self._init = jax.jit(lambda p, s: Centre(jnp.zeros((), jnp.int32), p, (), s),
                         out_shardings=meshes.replicated)

    def contribution(centre_params, params, model_state, n, alpha):
      d = jax.tree.map(lambda x, c: alpha * (x - c).astype(jnp.float32), params, centre_params)
      return {"d": d, "model_state": jax.tree.map(lambda s: n * s, model_state)}

    self._contribution = jax.jit(contribution, out_shardings=meshes.local_replicated)
    self._pull = jax.jit(lambda params, d: jax.tree.map(lambda x, v: (x - v).astype(x.dtype), params, d),
                         out_shardings=meshes.local_replicated, donate_argnums=(0,))

    def make_finish(mesh, axis):
      def finish(centre, totals, total_n):
        # Each slice of the centre computed by one device, then gathered
        # (`hetjax.step.sharding`), as the sync step's update.
        split = lambda tree: sharding_lib.split_tree(tree, mesh, axis)
        params = jax.tree.map(lambda c, v: (c + v).astype(c.dtype), split(centre.params),
                              split(totals["d"]))
        model_state = jax.tree.map(lambda s, old: (s / total_n).astype(old.dtype),
                                   split(totals["model_state"]), split(centre.model_state))
        gather = lambda tree, like: sharding_lib.gather_tree(tree, like, mesh, axis)
        return Centre(centre.round + 1, gather(params, centre.params), (),
                      gather(model_state, centre.model_state))
      return finish

    self._finish = rounds_lib.OuterUpdate(make_finish, backend, meshes)
    self._last_d = None

  def start(self, centre: Centre, host_params: PyTree, host_model_state: PyTree
            ) -> tuple[PyTree, PyTree]:
    """A host keeps its own parameters; the first round starts them at the centre."""
    if host_params is None:
      return rounds_lib.to_host_mesh((centre.params, centre.model_state), self.meshes)
    return host_params, host_model_state

  def alpha(self, n: int, total_n: int) -> float:
    return self.beta * n / total_n

  def contribution(self, centre: Centre, params: PyTree, model_state: PyTree, n: int,
                   total_n: int) -> dict:
    """`[d_i, n_i * model_state_i]` on this host's devices."""
    centre_params = mesh_lib.to_local_tree(centre.params, self.meshes)
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
