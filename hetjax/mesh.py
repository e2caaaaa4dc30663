"""Where arrays live: this host's mesh, the world's, and moving between them.

The local mesh (this host's devices: the train state, the local programs) and
the world mesh (every device, in (host, device) order: the cross-host program);
arrays cross between them by re-wrapping the same buffers, never by copying.
The few values every host must learn travel in one small gather
(`gather_host_values`), over the world or over one CPU per host (`Meshes.values_over`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax.cluster import watchdog

PyTree = Any
DEV = "dev"   # axis of the local mesh: this host's devices
ALL = "all"   # axis of the global mesh: every device of every host
HOSTS = "host"  # axis of the hosts' mesh: one CPU device per host
VALUES_OVER = ("device", "host")  # where `gather_host_values` runs (`Meshes.values_over`)


@dataclasses.dataclass(frozen=True)
class Meshes:
  """This host's mesh and the mesh of every device, in (host, device) order.

  `values_over`: "device", the world mesh; "host", one CPU per host (`hosts`), for jobs
  that reduce on the CPUs, whose accelerators may share no collective (two processes on one
  GPU, GPUs of two vendors).
  """

  local: Mesh
  world: Mesh
  num_hosts: int
  host_id: int
  values_over: str = "device"

  @classmethod
  def create(cls, values_over: str = "device") -> "Meshes":
    """The meshes of this process; `values_over` as the job's reduction backend."""
    if values_over not in VALUES_OVER:
      raise ValueError(f"values_over={values_over!r}: host values travel over 'device' (the "
                       "world mesh) or 'host' (one CPU device per host); pass the job's "
                       "reduction backend.")
    world = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local = [d for d in world if d.process_index == jax.process_index()]
    return cls(Mesh(np.array(local), (DEV,)), Mesh(np.array(world), (ALL,)),
               jax.process_count(), jax.process_index(), values_over)

  @property
  def local_devices(self) -> int:
    return self.local.devices.size

  @property
  def one_device(self) -> bool:
    """A world of one device: its sums row is the total as it is (`Reduced.total`)."""
    return self.world.devices.size == 1

  def devices_per_host(self) -> tuple[int, ...]:
    """How many devices each host brings (hosts may differ)."""
    hosts = np.array([d.process_index for d in self.world.devices.flat])
    return tuple(int(np.sum(hosts == h)) for h in range(self.num_hosts))

  @functools.cached_property
  def hosts(self) -> Mesh:
    """Each host's first CPU device (axis `HOSTS`): where the host reduction sums; any
    platform has CPU devices, whose collectives (gloo) ignore the accelerators."""
    cpus = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    firsts = [next(d for d in cpus if d.process_index == h) for h in range(self.num_hosts)]
    return Mesh(np.array(firsts), (HOSTS,))

  # Shardings built once, not per leaf per step.
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


@functools.lru_cache(maxsize=None)
def _first_rows(mesh: Mesh) -> np.ndarray:
  """The index of each host's first device in a 1-D `mesh`, in host order (read every step,
  built once)."""
  hosts = np.array([d.process_index for d in mesh.devices.flat])
  return np.array([np.argmax(hosts == h) for h in range(int(hosts.max()) + 1)])


def _rows_on(values: np.ndarray, mesh: Mesh) -> jax.Array:
  """This host's vector as its rows of a `[devices of mesh, k]` array split over `mesh`."""
  values = np.asarray(values, np.float32).reshape(1, -1)
  mine = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(mesh.axis_names[0])), np.repeat(values, mine, axis=0))


def host_rows(values: np.ndarray, meshes: Meshes) -> jax.Array:
  """This host's vector as its rows of a world-sharded `[all devices, k]` array."""
  return _rows_on(values, meshes.world)


def rows_by_host(rows: np.ndarray, meshes: Meshes) -> np.ndarray:
  """The first row of each host from a gathered `[all devices, k]` array."""
  return np.asarray(rows)[_first_rows(meshes.world)]


def to_local_tree(tree: PyTree, meshes: Meshes) -> PyTree:
  """`to_local` on every leaf: a state made or restored as global arrays, once."""
  return jax.tree.map(lambda x: to_local(x, meshes), tree)


def to_global_tree(tree: PyTree, meshes: Meshes) -> PyTree:
  """Local replicated arrays re-wrapped, zero-copy, as global replicated ones (orbax's form)."""
  return jax.tree.map(lambda x: _rewrap(x, x.shape, meshes.replicated), tree)


@functools.lru_cache(maxsize=None)
def _all_gather(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
  return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


def gather_host_values(values: np.ndarray, meshes: Meshes) -> np.ndarray:
  """Every host's `values` vector, `[hosts, k]`, from one small collective over
  `meshes.values_over`'s mesh (every host must call it, in the same order)."""
  mesh = meshes.hosts if meshes.values_over == "host" else meshes.world
  with watchdog.waiting():  # The watchdog names first the hosts that are not waiting here.
    rows = np.asarray(_all_gather(mesh)(_rows_on(values, mesh)))
  return rows[_first_rows(mesh)]


def choose_reduction(reduction: str) -> str:
  """The reduction backend: `reduction`, or for 'auto' what the platform can do, alike on
  every host: 'device' wherever the world's devices can share a collective (CPU hosts,
  accelerators one rank each); 'host' where two processes drive one GPU (two ranks NCCL
  cannot place), decided from every host's machine and device numbers gathered over the CPUs.
  """
  if reduction != "auto":
    return reduction
  if jax.process_count() == 1 or all(d.platform == "cpu" for d in jax.devices()):
    return "device"
  import socket

  from hetjax.config import fingerprint
  mask = sum(1 << (d.local_hardware_id if d.local_hardware_id is not None else d.id) % 64
             for d in jax.local_devices())
  chunks = np.frombuffer(np.uint64(mask).tobytes(), np.uint16).astype(np.float32)
  mine = np.concatenate([fingerprint(socket.gethostname()), chunks])
  return "host" if shares_a_device(gather_host_values(mine, Meshes.create("host"))) else "device"


def shares_a_device(rows: np.ndarray) -> bool:
  """Whether two hosts' rows (machine fingerprint [4], device bit mask [4 x 16 bits]) name
  one device of one machine."""
  machines, masks = rows[:, :4], rows[:, 4:8].astype(np.uint16)
  return any(np.array_equal(machines[i], machines[j]) and np.any(masks[i] & masks[j])
             for i in range(len(rows)) for j in range(i))
