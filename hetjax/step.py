"""The two compiled programs of one training step.

LOCAL (`LocalProgram`): `jit(shard_map)` over this host's own devices. The
host's share, a whole number of blocks of `m` positions (`hetjax.blocks`),
is fed as fixed-shape micro-batches of one block per device (the last ones
padded and masked); each device keeps running sums of per-example gradients,
losses, metrics, weights and the count of real examples. A block's PRNG key
is `fold_in(fold_in(key(seed), step), block)`, whichever device runs it. No cross-host collective runs here,
so hosts may run different numbers of micro-batches, and a new share changes
only how often the same compiled program runs (invariant 4).

CROSS-HOST (`DeviceReduction` / `HostReduction`): the per-device sums are
stitched, zero-copy, into global arrays of shape `[all devices, ...]`; one
reduction gives `sum(grad sums) / sum(counts)` (invariant 2), then the optax
update produces the next train state as global replicated arrays.

Every host contributes one row per local device, so hosts may even have
different numbers of devices. The rows also carry a small host vector
(timings, stop requests, shares): each device row of host `h` ends with host
`h`'s values, so every host learns every host's values from the same
collective (invariant 3).

Per-step work does not grow with the number of parameter arrays (`Layout`):
each device's sums are one float32 row, so they cross to the world mesh as
one array, and the global program hands the local one its parameters packed
into one buffer per dtype (`HostViews`). A step launches one program per
micro-batch and one reduction, and re-wraps two arrays, for 6 leaves or
600. What a step sends from the host beyond the user's arrays travels in one
small int32 array per micro-batch (`_POSITION`): each device's step, block,
number of real examples (its mask is built on the device) and the host
vector, so a step makes as many transfers as a plain loop's batch has
arrays. Under `precision` bf16 / fp16 the local program computes in the low
type from float32 master parameters; sums and the reduction stay float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax import optimizers as optimizers_lib
from hetjax import packing
from hetjax import precision as precision_lib
from hetjax.task import MASK, Task, split_losses

PyTree = Any
LEARNING_RATE = "hetjax.lr"  # Stats entry: the update's learning rate, when the optimizer shows it.
DEV = "dev"   # axis of the local mesh: this host's devices
# Batch entry, one int32 row per device: step, block, first micro-batch?, real
# examples, then the host vector's float32 bits (`_position_rows`).
_POSITION = "hetjax.position"
_POSITION_FIELDS = 4
ALL = "all"   # axis of the global mesh: every device of every host


class TrainState(NamedTuple):
  """Everything the optimizer carries, as global replicated arrays."""

  step: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree
  loss_scale: precision_lib.LossScale  # (1, 0) unless fp16 scales its loss


class Sums(NamedTuple):
  """What one device sums over its micro-batches (packed into one float32 row)."""

  grads: PyTree
  weight: jax.Array     # the normaliser: real examples, or their `Weighted` weights
  count: jax.Array      # real examples
  loss: jax.Array
  metrics: dict[str, jax.Array]
  model_state: PyTree   # sum of count-weighted new model states (BatchNorm)


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

  # Shardings are built once: making one costs ~0.1 ms, paid per leaf per step.
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


def to_local(x: jax.Array, meshes: Meshes) -> jax.Array:
  """Re-wraps a global replicated array onto the local mesh, zero-copy."""
  shards = [s.data for s in x.addressable_shards]
  return jax.make_array_from_single_device_arrays(
      x.shape, meshes.local_replicated, shards)


def to_world(x: jax.Array, meshes: Meshes) -> jax.Array:
  """Stitches a local `[local devices, ...]` array into `[all devices, ...]`, zero-copy."""
  shape = (meshes.world.devices.size,) + x.shape[1:]
  return jax.make_array_from_single_device_arrays(
      shape, meshes.by_device, [s.data for s in x.addressable_shards])


def host_rows(values: np.ndarray, meshes: Meshes) -> jax.Array:
  """This host's vector as its rows of a world-sharded `[all devices, k]` array."""
  values = np.asarray(values, np.float32).reshape(1, -1)
  local = np.repeat(values, meshes.local_devices, axis=0)
  return jax.make_array_from_process_local_data(meshes.by_device, local)


def rows_by_host(rows: np.ndarray, meshes: Meshes) -> np.ndarray:
  """The first row of each host from a gathered `[all devices, k]` array."""
  return np.asarray(rows)[meshes.first_rows]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the step packs its arrays, fixed by the model's shapes.

  `views`: parameters, model state and loss scale, as the local program reads
  them (one buffer per dtype); `sums`: one device's `Sums`, as one float32
  row, so a step's sums cross to the world mesh as one array.
  """

  views: packing.Packer
  sums: packing.Packer
  precision: str
  grads_size: int   # the gradient sums come first in the row: `row[:grads_size]`

  @property
  def row_size(self) -> int:
    return self.sums.sizes.get("float32", 0)


class HostViews:
  """This host's views of the parameters, reused from the program that made them.

  The global program packs the new parameters and model state into one
  buffer per dtype; re-wrapping those few buffers onto the local mesh costs
  the same for 6 leaves or 600. Views of a state the global program did not
  make (initial, restored) are packed by one small program.
  """

  def __init__(self, meshes: Meshes):
    self.meshes = meshes
    self._for: Any = None   # First parameter leaf of the state the views belong to.
    self._views: dict[str, jax.Array] | None = None
    self._pack = None

  def put(self, params: PyTree, views: dict[str, jax.Array]) -> None:
    self._for, self._views = jax.tree.leaves(params)[0], views

  def get(self, layout: Layout, params: PyTree, model_state: PyTree,
          scale: jax.Array) -> dict[str, jax.Array]:
    if self._views is None or jax.tree.leaves(params)[0] is not self._for:
      if self._pack is None:
        self._pack = jax.jit(lambda *t: layout.views.pack(t), out_shardings=self.meshes.replicated)
      self.put(params, self._pack(params, model_state, scale))
    return {k: to_local(v, self.meshes) for k, v in self._views.items()}


@jax.tree_util.register_pytree_node_class
class LocalSums:
  """The local program's output: one `[local devices, row + k]` float32 array.

  Each device's row is its packed `Sums` followed by the host vector (`k`
  values, the same on every device of the host).
  """

  def __init__(self, flat: jax.Array, layout: Layout, views: HostViews):
    self.flat, self.layout, self.views = flat, layout, views

  def tree_flatten(self):
    return (self.flat,), (self.layout, self.views)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def totals(self) -> Sums:
    """This host's sums, unpacked (summed over its devices): for tests and tools."""
    n = self.layout.row_size
    return self.layout.sums.unpack({"float32": jnp.sum(self.flat[:, :n], axis=0)})

  def host_values(self) -> np.ndarray:
    """The host vector the sums carry (read from the first device): for tests and tools."""
    return np.asarray(self.flat.addressable_data(0))[0, self.layout.row_size:]


def padded_chunks(batch: dict[str, np.ndarray],
                  size: int) -> Iterator[tuple[dict[str, np.ndarray], int]]:
  """Cuts a batch into `size`-row chunks, the last one padded: (chunk, real rows).

  Padding rows repeat the chunk's first (real) row: a loss that is NaN on an
  all-zero row (a count of zero tokens, say) stays finite, and the mask
  removes the copies from every sum with `where`.
  """
  n = len(next(iter(batch.values())))
  for start in range(0, n, size):
    part = {k: v[start:start + size] for k, v in batch.items()}
    real = min(size, n - start)
    if real < size:
      part = {k: np.concatenate([v, np.repeat(v[:1], size - real, axis=0)])
              for k, v in part.items()}
    yield part, real


def micro_batches(batch: dict[str, np.ndarray], size: int) -> Iterator[dict[str, np.ndarray]]:
  """Cuts a batch into `size`-row chunks with a `MASK`, the last one padded."""
  for part, real in padded_chunks(batch, size):
    part[MASK] = (np.arange(size) < real).astype(np.float32)
    yield part


def _position_rows(step: int, first_block: int, first: bool, real: int, per_device: int,
                   devices: int, host_values: np.ndarray) -> np.ndarray:
  """`_POSITION` of one micro-batch of `devices` blocks: `[devices, 4 + k]` int32.

  Device `d` runs block `first_block + d` with `clip(real - d * per_device, 0,
  per_device)` real examples; the host vector rides as its float32 bits.
  """
  d = np.arange(devices)
  fields = np.stack([np.full(devices, step), first_block + d, np.full(devices, int(first)),
                     np.clip(real - d * per_device, 0, per_device)], axis=1)
  bits = np.broadcast_to(host_values.view(np.int32), (devices, host_values.size))
  return np.concatenate([fields.astype(np.int32), bits], axis=1)


def block_sums(task: Task, params: PyTree, model_state: PyTree, block: dict[str, jax.Array],
               rng: jax.Array, scale: jax.Array, precision: str,
               blocks_full: bool = False) -> Sums:
  """One block's sums over its real examples: float32 gradients, loss, metrics, state.

  The one definition of what a device computes for a block, shared by the
  sync step and the rounds modes' local steps. `blocks_full` (fixed for a
  run): every block is all real or all padding, never partly; then the
  task's `unmasked_loss` serves, as the sums drop an all-padding block
  whole. Under bf16 / fp16 the model
  runs in the low type from float32 parameters, so the gradients come back
  float32; `scale` multiplies the loss before differentiation and is divided
  out of the gradients, only when `precision` scales its loss (a pass over
  every gradient otherwise spent dividing by 1).
  """
  compute = precision_lib.compute_dtype(precision)
  low, scaled = compute != jnp.float32, precision_lib.uses_loss_scale(precision)
  real = block[MASK] > 0
  masked_sum = lambda v: jnp.sum(jnp.where(real, v.astype(jnp.float32), 0.0))
  # An all-padding block (a host whose blocks do not fill its last device
  # round) shows the model an all-ones mask: masked BatchNorm over zero rows
  # would be NaN, and NaN survives `where` in the backward pass. Its rows are
  # copies of a real row, and every sum below uses `real`.
  model_block = {**block, MASK: jnp.where(jnp.any(real), block[MASK], 1.0)}
  loss_fn = task.training_loss(blocks_full)
  if low:
    model_block = precision_lib.cast_batch(model_block, compute, keep=(MASK,))

  def total_loss(p):
    if low:
      p = precision_lib.cast_floats(p, compute)
    losses, metrics, new_state = loss_fn(p, model_state, model_block, rng)
    values, weights = split_losses(losses)
    weight = masked_sum(weights) if weights is not None else jnp.sum(real.astype(jnp.float32))
    loss = masked_sum(values)
    return (loss * scale if scaled else loss), (loss, metrics, new_state, weight)

  (_, (loss, metrics, new_state, weight)), grads = jax.value_and_grad(
      total_loss, has_aux=True)(params)
  n = jnp.sum(real.astype(jnp.float32))
  unscale = (lambda g: g.astype(jnp.float32) / scale) if scaled else (
      lambda g: g.astype(jnp.float32))
  return Sums(grads=jax.tree.map(unscale, grads), weight=weight, count=n, loss=loss,
              metrics={k: masked_sum(v) for k, v in metrics.items()},
              model_state=jax.tree.map(lambda s: jnp.where(n > 0, s * n, 0.0), new_state))


class LocalProgram:
  """Accumulates this host's gradient sums over its micro-batches."""

  def __init__(self, task: Task, meshes: Meshes, microbatch_per_device: int,
               precision: str = "fp32", blocks_full: bool = False):
    """`blocks_full`: no block of the run is part padding (see `block_sums`)."""
    if microbatch_per_device < 1:
      raise ValueError(f"--microbatch must be >= 1, got {microbatch_per_device}.")
    self.meshes = meshes
    self.per_device = microbatch_per_device
    self.blocks_full = blocks_full
    self.micro = microbatch_per_device * meshes.local_devices
    self.precision = precision_lib.check(precision)
    self.views = HostViews(meshes)
    self.layout: Layout | None = None
    self._task = task
    self._key = None
    # Sums buffers recycled from two steps back: the last step's may still be
    # read (by its reduction, or the thread that times it) while this one runs.
    self._ring: list[jax.Array | None] = [None, None]
    self._calls = 0
    self._host_width: int | None = None  # k: the host vector's length, fixed by the first call.

  def _build(self, params, model_state, example, rng, host_width: int) -> None:
    """Fixes the packing layout and compiles the programs, once."""
    per_device = {k: v[:self.per_device] for k, v in example.items()}
    _, metrics, new_state = jax.eval_shape(self._task.loss, params, model_state, per_device, rng)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    shapes = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    sums_like = Sums(shapes(params), scalar, scalar, scalar, {k: scalar for k in metrics},
                     shapes(new_state))
    layout = self.layout = Layout(packing.Packer((shapes(params), shapes(model_state), scalar)),
                                  packing.Packer(sums_like, dtype=jnp.float32), self.precision,
                                  sum(x.size for x in jax.tree.leaves(params)))
    task, n, m = self._task, layout.row_size, self.per_device

    def per_device(views, sums, batch, key):
      params, model_state, scale = layout.views.unpack(views)
      # Without the cast, grad of a replicated input would already be summed
      # over the local devices; per-device sums let one reduction do it all.
      params = jax.lax.pcast(params, DEV, to="varying")
      batch = dict(batch)
      position = batch.pop(_POSITION)[0]
      step, block, first, real = (position[i] for i in range(_POSITION_FIELDS))
      host = jax.lax.bitcast_convert_type(position[_POSITION_FIELDS:], jnp.float32)
      batch[MASK] = (jnp.arange(m) < real).astype(jnp.float32)
      rng = jax.random.fold_in(jax.random.fold_in(key, step), block)
      row = layout.sums.pack(block_sums(task, params, model_state, batch, rng, scale,
                                        self.precision, self.blocks_full))["float32"]
      # The first micro-batch of a step starts from zero in a recycled buffer;
      # the host vector is set, not summed. One elementwise pass, in place.
      keep = (first == 0) & (jnp.arange(n + host.size) < n)
      return jnp.where(keep[None], sums, 0.0) + jnp.concatenate([row, host])[None]

    self._accumulate = jax.jit(
        jax.shard_map(per_device, mesh=self.meshes.local,
                      in_specs=(P(), P(DEV), P(DEV), P()), out_specs=P(DEV)),
        donate_argnums=(1,))
    # Compiled now, so that a first share of 0 later on compiles nothing.
    d, k = self.meshes.local_devices, host_width
    self._host_width = k
    self._zeros = jax.jit(
        lambda host: jnp.broadcast_to(jnp.concatenate([jnp.zeros(n, jnp.float32), host]), (d, n + k)),
        in_shardings=self.meshes.local_replicated,
        out_shardings=self.meshes.local_by_device).lower(
            jax.ShapeDtypeStruct((k,), jnp.float32)).compile()

  def __call__(self, params: PyTree, model_state: PyTree, batch: dict[str, np.ndarray],
               example: dict[str, np.ndarray], key: jax.Array, step: int,
               first_block: int = 0, loss_scale: jax.Array | None = None,
               host_values: np.ndarray | None = None) -> LocalSums:
    """Runs the host's share `batch` (possibly empty) through the local program.

    `example` is one record of the dataset; it fixes the micro-batch shapes
    even when this host's share is 0. `key` is the run's base PRNG key; the
    step and each device's global block index (from `first_block`, the
    host's first block) are folded in on the devices. `loss_scale` (fp16)
    multiplies the loss before differentiation; the sums come back unscaled.
    `host_values` (float32, the same length every call) ride along in the
    sums to the reduction, which gathers every host's.
    """
    host = np.zeros(0, np.float32) if host_values is None else (
        np.asarray(host_values, np.float32).ravel())
    if self._host_width is not None and host.size != self._host_width:
      raise ValueError(f"host_values has {host.size} values; this program was built for "
                       f"{self._host_width} (pass the same length every step).")
    if self._key is None or self._key[0] is not key:
      self._key = (key, jax.device_put(key, self.meshes.local_replicated))
    local_key = self._key[1]
    if loss_scale is None:
      loss_scale = jnp.float32(1.0)
    if self.layout is None:
      local = lambda t: jax.tree.map(lambda x: to_local(x, self.meshes), t)
      self._build(local(params), local(model_state),
                  next(micro_batches(example, self.micro)), local_key, host.size)
    views = self.views.get(self.layout, params, model_state, loss_scale)
    slot = self._calls % 2
    sums, first = self._ring[slot], True
    if sums is None or sums.is_deleted():
      sums = self._zeros(host)
    d = self.meshes.local_devices
    for i, (micro, real) in enumerate(padded_chunks(batch, self.micro)):
      # Position, mask and host vector ride in the batch's one transfer.
      micro[_POSITION] = _position_rows(step, first_block + i * d, first, real, self.per_device,
                                        d, host)
      micro = jax.device_put(micro, self.meshes.local_by_device)
      sums = self._accumulate(views, sums, micro, local_key)
      first = False
    if first:  # No micro-batch: the recycled buffer still holds old sums.
      sums = self._zeros(host)
    self._ring[slot] = sums
    self._calls += 1
    return LocalSums(sums, self.layout, self.views)


# ---- Cross-host reduction and update ------------------------------------


def init_state(task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               example_batch: dict[str, np.ndarray], seed: int,
               precision: str = "fp32") -> TrainState:
  """Initialises the train state as global replicated arrays (same on every host)."""

  def init(seed, batch):
    params, model_state = task.init(jax.random.key(seed), batch)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state,
                      precision_lib.initial_scale(precision))

  return jax.jit(init, out_shardings=meshes.replicated)(np.int32(seed), example_batch)


def _update(optimizer: optax.GradientTransformation, state: TrainState, total: jax.Array,
            layout: Layout, overflow: jax.Array) -> tuple[TrainState, dict[str, jax.Array], dict]:
  """`sum(grad sums) / sum(weights)`, the optax update, the weighted model state.

  `total` is the sums row added over every device. Also returns the new
  state's packed views for the local program. On an fp16 overflow (some
  host's sums not finite) the update is skipped and the loss scale halved,
  the same on every host.
  """
  totals = layout.sums.unpack({"float32": total})
  count = totals.count
  # count == 0 is reported by the trainer as an error; a zero total weight
  # leaves the gradient zero rather than NaN.
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  # One division over the row's gradient segment: per leaf it was a kernel
  # each (0.1 ms of resnet18's update on XLA:CPU); the same float32 values.
  g = layout.grads_size
  normalized = layout.sums.unpack({"float32": jnp.concatenate([total[:g] / norm, total[g:]])})
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), normalized.grads, state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  safe = jnp.maximum(count, 1.0)
  model_state = jax.tree.map(
      lambda old, s: jnp.where(count > 0, s / safe, old).astype(old.dtype),
      state.model_state, totals.model_state)
  stats = {"count": count, "loss": totals.loss / norm}
  stats.update({k: v / norm for k, v in totals.metrics.items()})
  if precision_lib.uses_loss_scale(layout.precision):
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(overflow, b, a), new, old)
    params, opt_state, model_state = keep(
        (params, opt_state, model_state), (state.params, state.opt_state, state.model_state))
    stats.update(loss_scale=state.loss_scale.scale, skipped=overflow.astype(jnp.float32))
  lr = optimizers_lib.find_learning_rate(opt_state)
  if lr is not None:
    stats[LEARNING_RATE] = jnp.asarray(lr, jnp.float32)
  loss_scale = precision_lib.next_scale(state.loss_scale, overflow, layout.precision)
  new = TrainState(state.step + 1, params, opt_state, model_state, loss_scale)
  return new, stats, layout.views.pack((params, model_state, loss_scale.scale))


class Reduced(NamedTuple):
  """A dispatched reduction's step statistics and host rows, still on the devices.

  Fetching them is the step's only wait for the devices; the trainer does it
  after dispatching the next step, so the devices never idle while Python
  prepares it (a plain JAX loop reads its loss one step late for the same
  reason).
  """

  stats: dict[str, jax.Array]
  rows: Any               # [all devices, k] on the world mesh, or [hosts, k] numpy
  meshes: Meshes | None   # None when `rows` are already one per host

  def fetch(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the step's global statistics, every host's row `[hosts, k]`); waits."""
    stats, rows = jax.device_get((self.stats, self.rows))  # One host sync for both.
    return stats, rows if self.meshes is None else rows_by_host(rows, self.meshes)


class DeviceReduction:
  """One fused global program over every device: NCCL on GPU, gloo on CPU.

  The fastest choice when every host's accelerators can join one collective
  (one GPU vendor and a working NCCL/RCCL across the job).
  """

  name = "device"

  def __init__(self, optimizer: optax.GradientTransformation, meshes: Meshes):
    self.meshes = meshes
    self._optimizer = optimizer
    self._program = None

  def _build(self, layout: Layout) -> None:
    scaled = precision_lib.uses_loss_scale(layout.precision)
    n = layout.row_size

    def program(state, world):
      sums, rows = world[:, :n], world[:, n:]
      # Each row's overflow flag (fp16): any of that device's sums not finite.
      bad = (~jnp.all(jnp.isfinite(sums), axis=1) if scaled
             else jnp.zeros(sums.shape[0], bool))
      new_state, stats, views = _update(self._optimizer, state, jnp.sum(sums, axis=0), layout,
                                        jnp.any(bad))
      return new_state, stats, jnp.concatenate([rows, bad[:, None].astype(rows.dtype)], 1), views

    self._program = jax.jit(program, out_shardings=self.meshes.replicated, donate_argnums=(0,))

  def __call__(self, state: TrainState, sums: LocalSums) -> tuple[TrainState, "Reduced"]:
    """Reduces and updates, without waiting: the new state and what to fetch later.

    The rows are every device's host vector, with a last column: 1 where that
    host's sums overflowed (fp16).
    """
    if self._program is None:
      self._build(sums.layout)
    state, stats, rows, views = self._program(state, to_world(sums.flat, self.meshes))
    sums.views.put(state.params, views)
    return state, Reduced(stats, rows, self.meshes)


class HostReduction:
  """Sums moved to host memory and reduced with CPU collectives (gloo).

  For jobs whose hosts cannot share one device collective (accelerators of
  different vendors or generations whose collective libraries do not
  interoperate): the CPU collective does not care what accelerator a host
  has. Each host first sums over its own devices, on the devices, then
  copies that one row to host memory: one device-to-host copy per step.
  """

  name = "host"

  def __init__(self, optimizer: optax.GradientTransformation, meshes: Meshes):
    self.meshes = meshes
    self._optimizer = optimizer
    cpus = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    firsts = [next(d for d in cpus if d.process_index == h) for h in range(meshes.num_hosts)]
    self._cpu_mesh = Mesh(np.array(firsts), ("host",))
    self._by_host = NamedSharding(self._cpu_mesh, P("host"))
    self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(self._cpu_mesh, P()))
    self._device_sum = None
    self._update = None
    # gloo sets up a communicator for a new set of devices on its first
    # collective and gives up if a peer is not there within 30 s (fixed in
    # XLA), so a host that compiles much later (a slower or busier machine)
    # would fail the first step. Set it up here: compile the probe, line the
    # hosts up on the all-device communicator (which waits as long as it
    # takes), then run it at once.
    probe = jax.make_array_from_process_local_data(self._by_host, np.zeros((1, 1), np.float32))
    gather = self._gather.lower(probe).compile()
    gather_host_values(np.zeros(1), meshes)
    gather(probe).block_until_ready()
  def _build(self, layout: Layout) -> None:
    n = layout.row_size
    # The host's sums over its devices, then its host vector (every device holds it).
    self._device_sum = jax.jit(lambda x: jnp.concatenate([jnp.sum(x[:, :n], axis=0), x[0, n:]]),
                               out_shardings=self.meshes.local_replicated)

    def reduce(x):  # [hosts, n + k] -> (the sum of the sums, every host's values)
      return jnp.sum(x[:, :n], axis=0), x[:, n:]

    self._reduce = jax.jit(reduce, out_shardings=NamedSharding(self._cpu_mesh, P()))

    def update(state, total, overflow):
      return _update(self._optimizer, state, total, layout, overflow)

    self._update = jax.jit(update, out_shardings=self.meshes.replicated, donate_argnums=(0,))

  def __call__(self, state: TrainState, sums: LocalSums) -> tuple[TrainState, "Reduced"]:
    """Reduces on the CPUs, updates on the devices; same contract as `DeviceReduction`.

    The CPU collective needs this host's sums in host memory, so this
    backend waits for the local programs; the update is not waited for.
    """
    layout = sums.layout
    if self._update is None:
      self._build(layout)
    # Summed over this host's devices on the devices; then one device-to-host copy.
    mine = np.asarray(self._device_sum(sums.flat).addressable_data(0))
    finite = np.all(np.isfinite(mine[:layout.row_size]))
    bad = float(precision_lib.uses_loss_scale(layout.precision) and not finite)
    values = np.concatenate([mine, [bad]])
    total, rows = jax.device_get(self._reduce(
        jax.make_array_from_process_local_data(self._by_host, values[None].astype(np.float32))))
    total = jax.make_array_from_process_local_data(self.meshes.replicated, total)
    state, stats, views = self._update(state, total, np.bool_(rows[:, -1].max() > 0))
    sums.views.put(state.params, views)
    return state, Reduced(stats, rows, None)


REDUCTIONS = {"device": DeviceReduction, "host": HostReduction}


def make_reduction(name: str, optimizer: optax.GradientTransformation, meshes: Meshes):
  """The cross-host reduction backend called `name` ('device' or 'host')."""
  if name not in REDUCTIONS:
    raise ValueError(f"unknown reduction backend {name!r}; choose 'device' or 'host'.")
  return REDUCTIONS[name](optimizer, meshes)


@functools.lru_cache(maxsize=None)
def _all_gather(meshes: Meshes) -> Callable[[jax.Array], jax.Array]:
  return jax.jit(lambda x: x, out_shardings=meshes.replicated)


def gather_host_values(values: np.ndarray, meshes: Meshes) -> np.ndarray:
  """Every host's `values` vector, `[hosts, k]`, from one small collective."""
  rows = _all_gather(meshes)(host_rows(values, meshes))
  return rows_by_host(np.asarray(rows), meshes)
