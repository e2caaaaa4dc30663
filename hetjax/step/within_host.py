"""Sharding within a host: parameters and gradient sums split over the host's own devices.

Why: otherwise the smallest GPU caps the model. A local program never crosses hosts, so each
host may split over its own devices (`decide`) without changing what crosses hosts.

How: each leaf keeps its shape, split over the host's `L` devices on one axis (`split_axis`;
whole if `L` divides none); each layer gathers its slabs where it runs and again for its
gradient (`layer_gather`), whose transpose reduce-scatters into each device's sums row at the
slab's places, so the row layout and the reduction are unchanged. Gathered values are copies:
the blocks' math (invariant 2), up to float order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax.mesh import DEV
from hetjax.step import layer_gather
from hetjax.task import Task

PyTree = Any
MODES = ("auto", "on", "off")


def split_axis(shape: tuple[int, ...], devices: int) -> int | None:
  """The axis a leaf of `shape` is split on over `devices`; None: kept whole."""
  fits = [a for a in range(min(1, len(shape) - 1), len(shape)) if shape[a] % devices == 0]
  return max(fits, key=lambda a: (shape[a], -a), default=None)


class Split:
  """How one host lays its whole `params` (arrays or shapes) out over its `devices`, `L` (see
  the module docstring)."""

  def __init__(self, params: PyTree, devices: int):
    self.devices = int(devices)
    self.like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    self._likes, self._treedef = jax.tree.flatten(self.like)
    self.axes = [split_axis(x.shape, self.devices) for x in self._likes]
    self.specs = jax.tree.unflatten(self._treedef, [
        P() if a is None else P(*([None] * a + [DEV])) for a in self.axes])

  def _each(self, fn: Callable, *trees: PyTree) -> PyTree:
    leaves = [jax.tree.leaves(t) for t in trees]
    return jax.tree.unflatten(self._treedef, [fn(a, *xs) for a, *xs in zip(self.axes, *leaves)])

  def chunk(self, params: PyTree) -> PyTree:
    """This device's slab of every whole leaf (inside a `shard_map`)."""
    d = jax.lax.axis_index(DEV)
    return self._each(lambda a, x: x if a is None else jax.lax.dynamic_slice_in_dim(
        x, d * (x.shape[a] // self.devices), x.shape[a] // self.devices, axis=a), params)

  def varying(self, params: PyTree) -> PyTree:
    """The slabs, with whole leaves cast to per-device values (their gradients stay per device)."""
    return self._each(lambda a, x: jax.lax.pcast(x, DEV, to="varying") if a is None else x,
                      params)

  def gathering(self, task: Task) -> Task:
    """`task` whose training losses take the slabs and gather each layer's where it runs."""
    def gather(slab, axis, after):
      if after is not None:  # Not before `after` exists, on any compiler.
        slab, _ = jax.lax.optimization_barrier((slab, after))
      return jax.lax.all_gather(slab, DEV, axis=axis, tiled=True)

    wrap = lambda loss: loss and layer_gather.wrap(loss, self.like, self.axes, gather)
    return dataclasses.replace(task, loss=wrap(task.loss),
                               unmasked_loss=wrap(task.unmasked_loss))

  def place(self, row: jax.Array, grads: PyTree, offsets: list[int]) -> jax.Array:
    """`row` (one device's `[1, width]`) plus this device's gradients at their places: leaf
    `i` from `offsets[i]` in row-major order, a slab over its own values."""
    d = jax.lax.axis_index(DEV)
    for x, a, like, offset in zip(jax.tree.leaves(grads), self.axes, self._likes, offsets):
      size, x = math.prod(like.shape), x.astype(row.dtype)
      if a is None:
        row = row.at[0, offset:offset + size].add(x.ravel())
        continue
      leaf = row[0, offset:offset + size].reshape(like.shape)
      start = d * x.shape[a]
      old = jax.lax.dynamic_slice_in_dim(leaf, start, x.shape[a], axis=a)
      leaf = jax.lax.dynamic_update_slice_in_dim(leaf, old + x, start, axis=a)
      row = row.at[0, offset:offset + size].set(leaf.ravel())
    return row

  def shapes(self, mesh: Mesh) -> PyTree:
    """The leaves' global shapes, each split over `mesh` as it is kept (for lowering)."""
    return jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, spec)), self.like, self.specs)

  def join(self, slabs: PyTree) -> PyTree:
    """The whole leaves from the slabs (inside a `shard_map`): for reads."""
    return self._each(lambda a, x: x if a is None else jax.lax.all_gather(
        x, DEV, axis=a, tiled=True), slabs)

  def bytes_per_device(self) -> dict[str, int]:
    """Parameter bytes a device keeps: whole, and as its slabs."""
    nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    whole = sum(nbytes(x) for x in self._likes)
    rows = sum(nbytes(x) // (1 if a is None else self.devices)
               for x, a in zip(self._likes, self.axes))
    return {"whole": int(whole), "rows": int(rows)}

  def state_specs(self, state_like: Any) -> Any:
    """`shard_map` specs of a train state whose parameters are slabs; the rest whole."""
    return state_like._replace(**{k: jax.tree.map(lambda _: P(), v)
                                  for k, v in state_like._asdict().items() if k != "params"},
                               params=self.specs)


def grad_offsets(packer: Any, params: PyTree) -> list[int]:
  """Where each gradient leaf starts in a sums row (`Sums.grads` packs first)."""
  return [slot.offset for slot in packer.slots[:len(jax.tree.leaves(params))]]


# ---- deciding, per host ------------------------------------------------------


class Decision(NamedTuple):
  """One host's choice and why (printed at start)."""

  on: bool
  reason: str

  def describe(self) -> str:
    return f"within-host sharding {'on' if self.on else 'off'} ({self.reason})"


def mode_of(value: str | tuple[str, ...], host: int) -> str:
  """This host's mode from `TrainConfig.shard_within_host` ('auto', or one per host)."""
  if isinstance(value, str):
    parts = [p.strip() for p in value.split(",")]
    return parts[0] if len(parts) == 1 else parts[host]
  return tuple(value)[host]


def decide(mode: str, devices: int, need_whole: int | None, need_rows: int | None,
           limit: int | None, emulated: bool, fraction: float) -> Decision:
  """Sharding on or off for one host.

  `need_whole` / `need_rows`: bytes without / with sharding (`estimate`); `limit`: device
  memory (`emulated`: given). 'auto' shards only when whole does not fit in `fraction` of it.
  """
  if devices < 2:
    return Decision(False, f"{mode}: one device, nothing to split over")
  if mode in ("on", "off"):
    return Decision(mode == "on", "as asked")
  if limit is None or need_whole is None:
    return Decision(False, "auto: the device reports no memory limit and none was given "
                           "(`device_memory`)")
  label = "emulated " if emulated else ""
  room = fraction * limit
  if need_whole <= room:
    return Decision(False, f"auto: {_gb(need_whole)} fits {fraction:g} of the {label}"
                           f"{_gb(limit)} device")
  fits = "fits" if need_rows is not None and need_rows <= room else "still does not fit"
  return Decision(True, f"auto: {_gb(need_whole)} exceeds {fraction:g} of the {label}"
                        f"{_gb(limit)} device; split over {devices}: {_gb(need_rows)} {fits}")


def _gb(n: int | None) -> str:
  return "?" if n is None else f"{n / 1e9:.3g} GB"


def peak_bytes(compiled: Any) -> int | None:
  """A compiled program's per-device peak from XLA's memory analysis: its arguments,
  outputs not aliased to them, and temporaries (None where the backend gives none)."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 (a backend without memory analysis: unknown)
    return None
  if m is None:
    return None
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
             + m.temp_size_in_bytes)
