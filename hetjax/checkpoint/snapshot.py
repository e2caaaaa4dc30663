"""A hold on a replicated train state that a checkpoint can write while training goes on.

The next reduction donates the state's buffers, so a save that reads them later
needs values of its own: one replica per host (the state is replicated), from
this host's first device:

- on CPU, a numpy view of each buffer, which copies nothing: JAX does not
  donate a buffer a view still references (where a view would need a copy,
  `np.asarray` makes one, just as correct);
- elsewhere, one program copying the leaves into pinned host memory (an
  asynchronous copy that spends no device memory).

The caller blocks only for the views or the copy's dispatch; the worker's
`Snapshot.as_global` makes what orbax saves in a multi-host job.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

PyTree = Any
HOST_MEMORY_PLATFORMS = ("cpu",)  # devices whose memory numpy can view in place


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """One replica of a replicated tree on this host, and the global layout it stands for."""

  treedef: Any
  local: list[Any]           # the replicas: viewed arrays, numpy copies, or pinned-host copies
  device: jax.Device         # this host's first device
  sharding: NamedSharding    # replicated over each host's first device
  views: list[np.ndarray]    # what keeps viewed buffers from being donated

  def as_global(self) -> PyTree:
    """The replicas as global arrays (one per host), what orbax saves."""
    def wrap(x):
      if not isinstance(x, jax.Array):  # A copy np.asarray made (on CPU, aliased, not copied).
        x = jax.device_put(x, self.device)
      return jax.make_array_from_single_device_arrays(x.shape, self.sharding, [x])
    return jax.tree.unflatten(self.treedef, [wrap(x) for x in self.local])


@dataclasses.dataclass(frozen=True)
class _Plan:
  device: jax.Device
  copy: Callable[[list], list] | None  # compiled copy to pinned host memory; None: views
  sharding: NamedSharding


class SnapshotTaker:
  """Takes one-replica-per-host snapshots of trees replicated over every device. `copy`: into
  host memory even where views would do (None: views on `HOST_MEMORY_PLATFORMS`, copies
  elsewhere), so tests run the GPU path on CPU."""

  def __init__(self, copy: bool | None = None):
    self._force_copy = copy
    self._plans: dict[Any, _Plan] = {}  # per (tree structure, mesh)

  def take(self, tree: PyTree, hosts: Mesh | None = None) -> Snapshot:
    """A snapshot of `tree` (every leaf replicated on one mesh), safe from later donation.

    `hosts`: a mesh over every host's devices, where the leaves live on this host's only.
    """
    leaves, treedef = jax.tree.flatten(tree)
    key = (treedef, getattr(leaves[0].sharding, "mesh", None) if leaves else None, hosts)
    plan = self._plans.get(key)
    if plan is None:
      plan = self._plans[key] = self._plan(leaves, hosts)
    local = [x.addressable_data(0) for x in leaves]
    if plan.copy is not None:
      return Snapshot(treedef, plan.copy(local), plan.device, plan.sharding, [])
    views = [np.asarray(x) for x in local]
    # A viewed buffer stays valid while its view lives; where np.asarray had
    # to copy, the copy is the snapshot.
    local = [x if v.size and v.ctypes.data == x.unsafe_buffer_pointer() else v
             for x, v in zip(local, views)]
    return Snapshot(treedef, local, plan.device, plan.sharding, views)

  def _plan(self, leaves: list[jax.Array], hosts: Mesh | None) -> _Plan:
    mesh = _replicated_mesh(leaves)
    firsts = _first_devices(mesh if hosts is None else hosts)
    device = firsts[jax.process_index()]
    if leaves[0].addressable_data(0).devices() != {device}:
      raise ValueError(f"the first local replica is on {leaves[0].addressable_data(0).devices()}, "
                       f"expected {device}, this host's first device in the mesh")
    copy = (device.platform not in HOST_MEMORY_PLATFORMS if self._force_copy is None
            else self._force_copy)
    kinds = {m.kind for m in device.addressable_memories()}
    kind = "pinned_host" if copy and "pinned_host" in kinds else device.default_memory().kind
    program = None
    if copy:
      program = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                        out_shardings=SingleDeviceSharding(device, memory_kind=kind))
    hosts = NamedSharding(Mesh(np.array(firsts), ("hosts",)), PartitionSpec(), memory_kind=kind)
    return _Plan(device, program, hosts)


def _replicated_mesh(leaves: list[jax.Array]) -> Mesh:
  meshes = {getattr(x.sharding, "mesh", None) for x in leaves}
  replicated = all(isinstance(x.sharding, NamedSharding) and x.sharding.is_fully_replicated
                   for x in leaves)
  if len(meshes) != 1 or not replicated:
    raise ValueError("a snapshot needs every leaf replicated on one mesh (the train state's "
                     f"layout); got {len(meshes)} mesh(es), all replicated: {replicated}")
  return meshes.pop()


def _first_devices(mesh: Mesh) -> list[jax.Device]:
  """Each host's first device in the mesh's order: where `addressable_data(0)` lives."""
  firsts: dict[int, jax.Device] = {}
  for d in mesh.devices.flat:
    firsts.setdefault(d.process_index, d)
  return [firsts[p] for p in sorted(firsts)]
