"""Where arrays live: this host's mesh, the world's, and moving between them.

A host's own devices form its local mesh, where the train state lives and
the local programs run; every device of every host, in (host, device)
order, forms the world mesh of the one cross-host program. Arrays cross
between the two by re-wrapping the same device buffers (zero-copy), never
by copying; the few host values every host must learn travel as one
`[all devices, k]` array.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

PyTree = Any
DEV = "dev"   # axis of the local mesh: this host's devices
ALL = "all"   # axis of the global mesh: every device of every host


@dataclasses.dataclass(frozen=True)
class Meshes:
  """This host's mesh and the mesh of every device, in (host, device) order."""

  local: Mesh
  world: Mesh
  num_hosts: int
  host_id: int

  @classmethod
  def create(cls) -> "Meshes":
    world = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local = [d for d in world if d.process_index == jax.process_index()]
    return cls(Mesh(np.array(local), (DEV,)), Mesh(np.array(world), (ALL,)),
               jax.process_count(), jax.process_index())

  @property
  def local_devices(self) -> int:
    return self.local.devices.size

  @property
  def one_device(self) -> bool:
    """A world of one device: its sums row is the total as it is (`Reduced.total`)."""
    return self.world.devices.size == 1

  def devices_per_host(self) -> tuple[int, ...]:
    """How many devices each host brings (hosts may differ)."""
    hosts = self.row_hosts()
    return tuple(int(np.sum(hosts == h)) for h in range(self.num_hosts))

  def row_hosts(self) -> np.ndarray:
    """The host of each row of a world-sharded `[all devices, ...]` array."""
    return np.array([d.process_index for d in self.world.devices.flat])

  @functools.cached_property
  def first_rows(self) -> np.ndarray:
    """The index of each host's first row, in host order: read every step, built once."""
    hosts = self.row_hosts()
    return np.array([np.argmax(hosts == h) for h in range(self.num_hosts)])

  # Shardings are built once: making one is Python work that would otherwise be paid per
  # leaf per step.
  @functools.cached_property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.world, P())

  @functools.cached_property
  def by_device(self) -> NamedSharding:
    return NamedSharding(self.world, P(ALL))

  @functools.cached_property
  def local_replicated(self) -> NamedSharding:
    return NamedSharding(self.local, P())

  @functools.cached_property
  def local_by_device(self) -> NamedSharding:
    return NamedSharding(self.local, P(DEV))


def _rewrap(x: jax.Array, shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
  """This host's buffers of `x` as an array of `shape` and `sharding`, zero-copy."""
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [s.data for s in x.addressable_shards])


def to_local(x: jax.Array, meshes: Meshes) -> jax.Array:
  """Re-wraps a global replicated array onto the local mesh, zero-copy."""
  return _rewrap(x, x.shape, meshes.local_replicated)


def to_world(x: jax.Array, meshes: Meshes) -> jax.Array:
  """Stitches a local `[local devices, ...]` array into `[all devices, ...]`, zero-copy."""
  return _rewrap(x, (meshes.world.devices.size,) + x.shape[1:], meshes.by_device)


def host_rows(values: np.ndarray, meshes: Meshes) -> jax.Array:
  """This host's vector as its rows of a world-sharded `[all devices, k]` array."""
  values = np.asarray(values, np.float32).reshape(1, -1)
  local = np.repeat(values, meshes.local_devices, axis=0)
  return jax.make_array_from_process_local_data(meshes.by_device, local)


def rows_by_host(rows: np.ndarray, meshes: Meshes) -> np.ndarray:
  """The first row of each host from a gathered `[all devices, k]` array."""
  return np.asarray(rows)[meshes.first_rows]


def to_local_tree(tree: PyTree, meshes: Meshes) -> PyTree:
  """`to_local` on every leaf: a state made or restored as global arrays, once."""
  return jax.tree.map(lambda x: to_local(x, meshes), tree)


def to_global_tree(tree: PyTree, meshes: Meshes) -> PyTree:
  """Local replicated arrays re-wrapped, zero-copy, as global replicated ones (orbax's form)."""
  return jax.tree.map(lambda x: _rewrap(x, x.shape, meshes.replicated), tree)



@functools.lru_cache(maxsize=None)
def _all_gather(meshes: Meshes) -> Callable[[jax.Array], jax.Array]:
  return jax.jit(lambda x: x, out_shardings=meshes.replicated)


def gather_host_values(values: np.ndarray, meshes: Meshes) -> np.ndarray:
  """Every host's `values` vector, `[hosts, k]`, from one small collective."""
  rows = _all_gather(meshes)(host_rows(values, meshes))
  return rows_by_host(np.asarray(rows), meshes)
