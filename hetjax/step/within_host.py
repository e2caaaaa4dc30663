"""Sharding within a host: parameters and gradient sums split over the host's own devices.

Why: every device otherwise holds the whole parameters and their whole
gradients, so the smallest GPU of a cluster caps the model. A local program
never crosses hosts, so a host may split over its own devices (its fast
links) without changing what crosses hosts, and each host decides for
itself (`decide`), as it does for device batches.

How (explicit collectives, measured against GSPMD annotations in
`bench/memory.py`): each parameter leaf is laid out `[L, c]` over the host's
`L` devices (`optimizer_layout.split_leaf`); device `d` keeps row `d`. Inside
the local program's `shard_map` the loss is replayed so that each leaf is
gathered at each use, once its other inputs exist, and gathered again in
the backward pass once that use's cotangent exists (`gather_at_use`): a
gathered leaf lives for one operation, so the program holds neither the
whole parameters nor the whole gradients at once (`bench/memory.py`).
The transpose of the gather is a reduce-scatter, so each device receives
its own row of the host's summed gradients, and writes it into its sums row
at that row's place (zeros elsewhere). The sums row keeps its layout: the
cross-host reduction adds every device's row as before, and the sum over a
host's devices is the host's sums, whichever way they were split. The
gathered values are copies and the summed rows hold the same terms, so the
math is the blocks' (invariant 2), up to float reduction order.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hetjax.mesh import DEV
from hetjax.step import gather_at_use
from hetjax.step.optimizer_layout import columns, join_leaf, split_leaf
from hetjax.task import Task

PyTree = Any
MODES = ("auto", "on", "off")


class Split:
  """How one host lays its parameters out over its `devices` (see the module docstring).

  Args:
    params: the parameters (arrays or shapes), whole: fixes shapes and dtypes.
    devices: `L`, this host's devices.
  """

  def __init__(self, params: PyTree, devices: int):
    self.devices = int(devices)
    self.like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    self._likes = jax.tree.leaves(self.like)

  def chunk(self, params: PyTree) -> PyTree:
    """This device's row `[1, c]` of every whole leaf (inside a `shard_map`)."""
    d = jax.lax.axis_index(DEV)
    return jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(split_leaf(x, self.devices), d, 1), params)

  def gathering(self, task: Task) -> Task:
    """`task` whose training losses take the rows and gather each leaf where it is used."""
    def one(row, i, tie):
      if tie is None:
        return join_leaf(jax.lax.all_gather(row, DEV, tiled=True), self._likes[i].shape)
      tied = jnp.concatenate([row, tie.astype(row.dtype)], axis=1)
      gathered = jax.lax.all_gather(tied, DEV, tiled=True)[:, :row.shape[1]]
      return join_leaf(gathered, self._likes[i].shape)

    def wrap(loss: Callable | None) -> Callable | None:
      if loss is None:
        return None
      return lambda rows, *args: gather_at_use.replay(loss, rows, one, *args)

    return _Gathering(task, wrap(task.loss), wrap(task.unmasked_loss))

  def place(self, row: jax.Array, grads: PyTree, offsets: list[int]) -> jax.Array:
    """`row` (one device's `[1, width]`) plus this device's gradient rows at their places.

    Leaf `i` starts at `offsets[i]`; device `d`'s row covers its values
    `[d c, d c + c)`. Past a leaf's end a row holds zeros (the gradient of
    the padding), so adding it over the next leaf's first values changes
    nothing; a row that would run past the buffer is added by a scatter
    that drops what falls outside.
    """
    d, width = jax.lax.axis_index(DEV), row.shape[-1]
    for x, offset in zip(jax.tree.leaves(grads), offsets):
      x = x.reshape(1, -1).astype(row.dtype)
      c = x.shape[-1]
      start = offset + d * c
      if offset + self.devices * c <= width:
        old = jax.lax.dynamic_slice_in_dim(row, start, c, axis=1)
        row = jax.lax.dynamic_update_slice_in_dim(row, old + x, start, axis=1)
      else:
        row = row.at[0, start + jnp.arange(c)].add(x[0], mode="drop")
    return row

  def shapes(self, sharding: NamedSharding) -> PyTree:
    """The rows' global shapes `[L, c]`, placed by `sharding` (for lowering)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (self.devices, columns(math.prod(x.shape), self.devices)), x.dtype, sharding=sharding),
        self.like)

  def join(self, chunks: PyTree) -> PyTree:
    """The whole leaves from the rows (inside a `shard_map`); no remat name: for reads."""
    return jax.tree.map(lambda x, like: join_leaf(jax.lax.all_gather(x, DEV, tiled=True),
                                                  like.shape), chunks, self.like)

  def bytes_per_device(self) -> dict[str, int]:
    """Parameter bytes a device keeps: whole, and as its rows."""
    leaves = jax.tree.leaves(self.like)
    whole = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
    rows = sum(columns(math.prod(x.shape), self.devices) * jnp.dtype(x.dtype).itemsize
               for x in leaves)
    return {"whole": int(whole), "rows": int(rows)}


class _Gathering(NamedTuple):
  """A task whose training losses gather their parameters first (`Split.gathering`)."""

  task: Task
  loss: Callable
  unmasked_loss: Callable | None

  def training_loss(self, blocks_full: bool) -> Callable:
    return self.unmasked_loss if (blocks_full and self.unmasked_loss) else self.loss


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

  `need_whole` / `need_rows`: a device's bytes without and with sharding
  (`estimate`); `limit`: the device's memory (`emulated`: from
  `device_memory`, on a backend that reports none). 'auto' shards only
  when the whole state does not fit in `fraction` of the limit.
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


def sharding_specs(state_like: Any) -> Any:
  """`shard_map` specs of a train state whose parameters are rows: `P(DEV)` there, else `P()`."""
  return state_like._replace(**{k: jax.tree.map(lambda _: P(), v)
                                for k, v in state_like._asdict().items() if k != "params"},
                             params=jax.tree.map(lambda _: P(DEV), state_like.params))
