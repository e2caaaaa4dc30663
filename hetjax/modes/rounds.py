"""What a round of hybrid and of elastic share.

A round, on every host: `TauPolicy` says how many local steps each host runs;
`RoundData` gives host i the contiguous slice after hosts `< i` of the next
`sum(tau) * b` stream positions; `LocalStep` runs each local step on the host's
own devices (no cross-host collective, so hosts run different numbers);
`RoundReduction` is the one reduction every host joins.

A block's key is `fold_in(fold_in(key(seed), round), block)`, `block`
counting the round's blocks in stream order (as the sync step counts a
step's), so with one local step per host a round is a sync step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax import blocks as blocks_lib
from hetjax import mesh as mesh_lib
from hetjax.balancer import taus_from_speeds  # noqa: F401 (numpy only, shared with the simulator)
from hetjax.mesh import Meshes
from hetjax.modes.local_step import LocalStep  # noqa: F401 (a round's local step)
from hetjax.step import reduction as reduction_lib

PyTree = Any
WARMUP_ROUNDS = 2   # Rounds run with tau = 1 while the hosts' speeds are measured.
SPEED_WINDOW = 8    # Rounds of local step times whose median sets the speeds.


# ---- 1. Local steps per host ---------------------------------------------


class TauPolicy:
  """Fixed counts, or counts from the hosts' measured seconds per local step (the same
  gathered vector on every host). The first `WARMUP_ROUNDS` rounds run tau = 1, unmeasured."""

  def __init__(self, round_steps: int, num_hosts: int, fixed: Sequence[int] | None = None):
    self.round_steps, self.num_hosts = int(round_steps), int(num_hosts)
    self.fixed = None if fixed is None else tuple(int(t) for t in fixed)
    self._seconds: list[list[float]] = []  # [rounds][hosts], per local step
    self._round = 0

  def taus(self, round_index: int) -> tuple[int, ...]:
    if self.fixed is not None:
      return self.fixed
    if not self._seconds:
      return (1,) * self.num_hosts
    return taus_from_speeds(self.round_steps, np.median(self._seconds[-SPEED_WINDOW:], axis=0))

  def observe(self, round_index: int, step_s: Sequence[float]) -> None:
    if round_index + 1 >= WARMUP_ROUNDS:
      self._seconds.append([float(s) for s in step_s])
      del self._seconds[:-SPEED_WINDOW]

  def state_dict(self) -> dict[str, Any]:
    return {"seconds": self._seconds}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    seconds = state.get("seconds", [])
    if seconds and len(seconds[0]) != self.num_hosts:
      return  # Another host count: measure afresh.
    self._seconds = [list(map(float, s)) for s in seconds]


# ---- 2. The round's data ---------------------------------------------------


class RoundData:
  """Stream positions of a round: host i's local step k, and the block it starts at."""

  def __init__(self, start: int, taus: Sequence[int], local_batch: int, block: int):
    self.start, self.taus, self.b, self.block = int(start), tuple(taus), int(local_batch), int(block)

  @property
  def size(self) -> int:
    """Positions the round consumes: every host's local steps of `b`."""
    return sum(self.taus) * self.b

  def samples(self) -> tuple[int, ...]:
    """`n_i`, samples each host processes this round."""
    return tuple(t * self.b for t in self.taus)

  def host_positions(self, host: int) -> np.ndarray:
    """Host `host`'s contiguous slice of the round's positions, all its local steps."""
    first = self.start + sum(self.taus[:host]) * self.b
    return first + np.arange(self.taus[host] * self.b, dtype=np.int64)

  def first_block(self, host: int, local_step: int) -> int:
    """The round-wide index of the first block of the host's local step."""
    per_step = blocks_lib.num_blocks(self.b, self.block)
    return (sum(self.taus[:host]) + local_step) * per_step


def read(source: Any, sampler: Any, positions: np.ndarray, augment: Callable | None) -> dict:
  """Records at stream `positions`, augmented by record (as `hetjax.input.loader` does)."""
  from hetjax.input import augment as augment_lib
  indices = sampler.at(positions)
  batch = source[indices]
  if augment is not None:
    epochs = positions // sampler.num_records
    batch = augment(batch, augment_lib.example_keys(sampler.seed, epochs, indices))
  return batch


@jax.jit
def _distance(mine: PyTree, my_weight: jax.Array, totals: PyTree, total_weight: jax.Array
              ) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(m / my_weight - t / total_weight))
                      for m, t in zip(jax.tree.leaves(mine), jax.tree.leaves(totals))))


def spread(mine: PyTree, my_weight: float, totals: PyTree, total_weight: float,
           meshes: Meshes) -> jax.Array:
  """`||x_i - mean||` from what the round's reduction already holds, on this host's devices.

  Both modes reduce `sum_j w_j (x_j - c)` (up to sign): `totals / total_weight` is the
  sample-weighted mean minus `c` and `mine / my_weight` is `x_i - c`, so no second sum.
  """
  local = mesh_lib.to_local_tree(totals, meshes)
  return _distance(mine, jnp.float32(my_weight), local, jnp.float32(total_weight))


def to_host_mesh(tree: PyTree, meshes: Meshes) -> PyTree:
  """A copy of global replicated arrays on this host's devices (local mesh)."""
  return jax.tree.map(lambda x: jnp.copy(mesh_lib.to_local(x, meshes)), tree)


# ---- 4. The one cross-host reduction of a round, and the outer update -------


class RoundReduction:
  """Sums one per-host tree over the hosts (into global replicated arrays) and gathers a
  small vector from each: 'device', one program over every device (each host's tree on its
  first device row); 'host', CPU collectives over one CPU per host, for accelerators that
  cannot share one collective."""

  def __init__(self, backend: str, meshes: Meshes):
    if backend not in ("device", "host"):
      raise ValueError(f"unknown reduction backend {backend!r}; choose 'device' or 'host'.")
    self.backend, self.meshes = backend, meshes
    d = meshes.local_devices
    self._spread = jax.jit(
        lambda t: jax.tree.map(lambda x: jnp.zeros((d,) + x.shape, x.dtype).at[0].set(x), t),
        out_shardings=meshes.local_by_device)
    self._sum_world = jax.jit(
        lambda t, rows: (jax.tree.map(lambda x: jnp.sum(x, axis=0), t), rows),
        out_shardings=meshes.replicated)
    if backend == "host":
      reduction_lib.check_values_over_hosts(meshes, "the host reduction")
      mesh = meshes.hosts
      self._by_host = NamedSharding(mesh, P(mesh_lib.HOSTS))
      self._sum_hosts = jax.jit(lambda t: jax.tree.map(lambda a: jnp.sum(a, axis=0), t),
                                out_shardings=NamedSharding(mesh, P()))
      reduction_lib.line_up(self._sum_hosts, self._by_host, meshes)

  def __call__(self, tree: PyTree, host_values: np.ndarray) -> tuple[PyTree, np.ndarray]:
    """`(sum over hosts of tree, as global replicated arrays; [hosts, k] values)`."""
    meshes = self.meshes
    if self.backend == "device":
      world = jax.tree.map(lambda x: mesh_lib.to_world(x, meshes), self._spread(tree))
      totals, rows = self._sum_world(world, mesh_lib.host_rows(host_values, meshes))
      return totals, mesh_lib.rows_by_host(np.asarray(rows), meshes)
    mine = jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[None], tree)
    to_cpu = lambda x: jax.make_array_from_process_local_data(self._by_host, x)
    # The host values ride in the same collective: row h holds host h's vector.
    values = np.asarray(host_values, np.float32).reshape(-1)
    placed = np.zeros((1, meshes.num_hosts, values.size), np.float32)
    placed[0, meshes.host_id] = values
    mine["hetjax.host_values"] = placed
    totals = jax.device_get(self._sum_hosts(jax.tree.map(to_cpu, mine)))
    rows = np.asarray(totals.pop("hetjax.host_values"))
    replicated = meshes.replicated
    totals = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x), totals)
    return totals, rows


OuterProgram = Callable[[PyTree, PyTree, jax.Array], PyTree]


class OuterUpdate:
  """A mode's outer update, `finish(centre, totals, total_n) -> centre`, where the
  round's reduction summed: the centre comes and goes as global replicated arrays.

  `make(mesh, axis)` writes the update over a 1-D mesh, each slice computed by one device
  and gathered (invariant 6): 'device' over every device, 'host' over one CPU per host
  (through host memory: no program spans the hosts' accelerators).
  """

  def __init__(self, make: Callable[[Mesh, str], OuterProgram], backend: str, meshes: Meshes):
    self.meshes, self.on_cpus = meshes, backend == "host"
    mesh, axis = (meshes.hosts, mesh_lib.HOSTS) if self.on_cpus else (meshes.world, mesh_lib.ALL)
    self._sharding = NamedSharding(mesh, P())
    self._program = jax.jit(make(mesh, axis), out_shardings=self._sharding, donate_argnums=(0,))

  def __call__(self, centre: PyTree, totals: PyTree, total_n: jax.Array) -> PyTree:
    if not self.on_cpus:
      return self._program(centre, totals, total_n)
    # Every host's copy of a replicated array is whole: the first local one will do.
    mine = lambda t: jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), t)
    place = lambda t, sharding: jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, x), t)
    new = self._program(place(mine(centre), self._sharding), place(mine(totals), self._sharding),
                        total_n)
    return place(mine(new), self.meshes.replicated)
