"""The compiled programs of one training step (where arrays live: `hetjax.mesh`).

LOCAL (`LocalProgram`): `jit(shard_map)` over this host's own devices, where
the train state lives (replicated over them). The first micro-batch's
program first applies the previous step's update (`apply_update`) from the
summed row the reduction left, then every micro-batch adds its gradients.
The host's share, a whole number of blocks of `m` positions
(`hetjax.blocks`), is fed as fixed-shape micro-batches of one block per
device (the last ones padded and masked); each device keeps running sums of
per-example gradients, losses, metrics, weights and the count of real
examples. A block's PRNG key is `fold_in(fold_in(key(seed), step), block)`,
whichever device runs it. No cross-host collective runs here, so hosts may
run different numbers of micro-batches, and a new share changes only how
often the same compiled programs run (invariant 4).

CROSS-HOST (`DeviceReduction` / `HostReduction`): the per-device rows are
stitched, zero-copy, into one global array of shape `[all devices, ...]`;
one small program sums them (invariant 2: the update divides
`sum(grad sums)` by `sum(counts)`) and computes the step's statistics. In a
world of one device the summed row is the next update, applied by the next
step's first local program. In a larger world the same program also runs
the sharded update (`hetjax.sharding`, ZeRO stage 1): each device updates
its slice of every parameter, model-state and optimizer-state leaf, and the
new parameters and model state are all-gathered and packed, so every bit of
every replica comes from one computation, however differently the hosts
compile (issue 25); the next local program unpacks them. The host backend
runs it over its CPU mesh (one device per host).

Every host contributes one row per local device, so hosts may even have
different numbers of devices. The rows also carry a small host vector
(timings, stop requests, shares): each device row of host `h` ends with host
`h`'s values, so every host learns every host's values from the same
collective (invariant 3).

Per-step work does not grow with the number of parameter arrays: each
device's sums are one float32 row, so they cross to the world mesh as one
array and come back as one; the state never leaves the host's devices. A
step launches one program per micro-batch and one reduction, and re-wraps
at most two arrays (none in a one-device world), for 6 leaves or 600. What
a step sends from the host beyond the user's arrays travels in one small
int32 array per micro-batch (`_POSITION`): each device's step, block,
number of real examples (its mask is built on the device) and the host
vector, so a step makes as many transfers as a plain loop's batch has
arrays. Under `precision` bf16 / fp16
the local program computes in the low type from float32 master parameters;
sums, the reduction and the update stay float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax import optimizers as optimizers_lib
from hetjax import packing
from hetjax import precision as precision_lib
from hetjax.mesh import ALL, DEV, Meshes, gather_host_values, rows_by_host, to_local, to_world
from hetjax.task import MASK, Task, split_losses

PyTree = Any
# Batch entry, one int32 row per device: step, block, first micro-batch?, real
# examples, then the host vector's float32 bits (`_position_rows`).
_POSITION = "hetjax.position"
_POSITION_FIELDS = 4


class TrainState(NamedTuple):
  """Everything the optimizer carries: replicated on this host's devices while
  training (`to_local_tree`), as global replicated arrays where every host
  holds one (`init_state`, checkpoints, `Trainer.state`)."""

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
class Layout:
  """How one device's sums travel, fixed by the model's shapes.

  A device's row is `[sums | loss scale | host vector]`: its `Sums` packed
  into float32 (`row_size` values, summed over devices), so a step's sums
  cross to the world mesh as one array; then the loss scale the step ran
  with and the host vector's `k` values, both set rather than summed.
  """

  sums: packing.Packer
  precision: str

  @property
  def row_size(self) -> int:
    return self.sums.sizes.get("float32", 0)


@jax.tree_util.register_pytree_node_class
class LocalSums:
  """The local program's output: one `[local devices, row + 1 + k]` float32 array.

  Each device's row is its packed `Sums`, the loss scale, then the host
  vector (`k` values, the same on every device of the host): `Layout`.
  """

  def __init__(self, flat: jax.Array, layout: Layout):
    self.flat, self.layout = flat, layout

  def tree_flatten(self):
    return (self.flat,), (self.layout,)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def totals(self) -> Sums:
    """This host's sums, unpacked (summed over its devices): for tests and tools."""
    n = self.layout.row_size
    return self.layout.sums.unpack({"float32": jnp.sum(self.flat[:, :n], axis=0)})

  def host_values(self) -> np.ndarray:
    """The host vector the sums carry (read from the first device): for tests and tools."""
    return np.asarray(self.flat.addressable_data(0))[0, self.layout.row_size + 1:]


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


class Local(NamedTuple):
  """One step's work on this host's devices."""

  state: TrainState                # this host's train state, the pending update applied
  sums: LocalSums
  learning_rate: jax.Array | None  # of the update applied (NaN if hidden); None: none was


class LocalProgram:
  """Applies the last step's update (or unpacks the sharded update's result, `replica`),
  then accumulates this host's gradient sums.

  The train state lives on this host's devices. The update of step `s`
  (`apply_update`, from the reduction's summed row) runs at the start of
  step `s + 1`'s first micro-batch, in the same program: on XLA:CPU a
  separate update program's hundreds of small kernels cannot overlap the
  backward pass as they do inside one program, and nothing is re-wrapped
  per leaf. Where no micro-batch follows (a share of 0, a checkpoint, the
  end of `fit`), `update` applies it alone: the same function, and every
  host applies every update, so the replicas stay equal.
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               microbatch_per_device: int, precision: str = "fp32", blocks_full: bool = False,
               replica: packing.Packer | None = None):
    """`blocks_full`: no block of the run is part padding (see `block_sums`).

    `replica`: the sharded update's packing of the state (`hetjax.sharding`);
    then the update ran in the reduction, a pending update is that packed
    new state, and the first micro-batch's program only unpacks it.
    """
    if microbatch_per_device < 1:
      raise ValueError(f"--microbatch must be >= 1, got {microbatch_per_device}.")
    self.meshes = meshes
    self.per_device = microbatch_per_device
    self.blocks_full = blocks_full
    self.micro = microbatch_per_device * meshes.local_devices
    self.precision = precision_lib.check(precision)
    self.layout: Layout | None = None
    self._task, self._optimizer = task, optimizer
    self.replica = replica
    # The sharded update's new state alone (a share of 0, a read of the state;
    # also before the first step, so not built with the other programs).
    self._unpack = None if replica is None else jax.jit(
        replica.unpack, out_shardings=meshes.local_replicated)
    self._key = None
    # Sums buffers recycled from two steps back: the last step's may still be
    # read (by its reduction, or the thread that times it) while this one runs.
    self._ring: list[jax.Array | None] = [None, None]
    self._calls = 0
    self._host_width: int | None = None  # k: the host vector's length, fixed by the first call.

  def _build(self, state: TrainState, example: dict[str, np.ndarray], rng: jax.Array,
             host_width: int) -> None:
    """Fixes the row layout and compiles the programs, once."""
    per_device = {k: v[:self.per_device] for k, v in
                  next(micro_batches(example, self.micro)).items()}
    _, metrics, new_state = jax.eval_shape(self._task.loss, state.params, state.model_state,
                                           per_device, rng)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    shapes = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    sums_like = Sums(shapes(state.params), scalar, scalar, scalar, {k: scalar for k in metrics},
                     shapes(new_state))
    layout = self.layout = Layout(packing.Packer(sums_like, dtype=jnp.float32), self.precision)
    task, optimizer, n, m = self._task, self._optimizer, layout.row_size, self.per_device

    def grad_row(state, sums, batch, key):
      # Without the cast, grad of a replicated input would already be summed
      # over the local devices; per-device sums let one reduction do it all.
      params = jax.lax.pcast(state.params, DEV, to="varying")
      batch = dict(batch)
      position = batch.pop(_POSITION)[0]
      step, block, first, real = (position[i] for i in range(_POSITION_FIELDS))
      host = jax.lax.bitcast_convert_type(position[_POSITION_FIELDS:], jnp.float32)
      batch[MASK] = (jnp.arange(m) < real).astype(jnp.float32)
      rng = jax.random.fold_in(jax.random.fold_in(key, step), block)
      scale = state.loss_scale.scale
      row = layout.sums.pack(block_sums(task, params, state.model_state, batch, rng, scale,
                                        self.precision, self.blocks_full))["float32"]
      # The first micro-batch of a step starts from zero in a recycled buffer;
      # the scale and host vector are set, not summed. One elementwise pass, in place.
      row = jnp.concatenate([row, scale[None], host])[None]
      if sums is None:
        return row
      keep = (first == 0) & (jnp.arange(n + 1 + host.size) < n)
      return jnp.where(keep[None], sums, 0.0) + row

    def update_then_grad(state, total, batch, key):
      # Always a step's first micro-batch: its row starts the sums, so the
      # recycled buffer is neither read nor cleared (a pass over the row saved).
      state, lr = apply_update(optimizer, state, total, layout)
      return state, lr, grad_row(state, None, batch, key)

    replica = self.replica

    def unpack_then_grad(packed, batch, key):
      # The sharded update's new state, gathered: unpacked where it is first read.
      state = replica.unpack(packed)
      return state, grad_row(state, None, batch, key)

    local, d, k = self.meshes.local, self.meshes.local_devices, host_width
    self._host_width = k
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    micro = dict(next(padded_chunks(example, self.micro))[0])
    micro[_POSITION] = _position_rows(0, 0, True, 0, m, d, np.zeros(k, np.float32))
    replicated = lambda shape, dtype: jax.ShapeDtypeStruct(
        shape, dtype, sharding=self.meshes.local_replicated)
    sums_like = jax.ShapeDtypeStruct((d, n + 1 + k), jnp.float32,
                                     sharding=self.meshes.local_by_device)
    total_like = sums_like if self.meshes.one_device else replicated((n,), jnp.float32)
    if replica is not None:
      total_like = {g: replicated((size,), jnp.dtype(g)) for g, size in replica.sizes.items()}
    micro_like = jax.tree.map(like, jax.device_put(micro, self.meshes.local_by_device))
    self._abstract = (micro_like, total_like)
    # Every program is compiled at a step every host reaches, whatever its
    # share: the first call (and, for the update, the first with one pending).
    # A new share then compiles nothing on any host (invariant 4).
    self._grad = jax.jit(
        jax.shard_map(grad_row, mesh=local, in_specs=(P(), P(DEV), P(DEV), P()),
                      out_specs=P(DEV)),
        donate_argnums=(1,)).lower(state, sums_like, micro_like, rng).compile()
    self._update_then_grad = None
    if replica is not None:
      self._fused_program = jax.jit(
          jax.shard_map(unpack_then_grad, mesh=local, in_specs=(P(), P(DEV), P()),
                        out_specs=(P(), P(DEV))))
    else:
      self._fused_program = jax.jit(
          jax.shard_map(update_then_grad, mesh=local, in_specs=(P(), P(), P(DEV), P()),
                        out_specs=(P(), P(), P(DEV))),
          donate_argnums=(0,))
      self._update_alone = jax.jit(
          jax.shard_map(lambda state, total: apply_update(optimizer, state, total, layout),
                        mesh=local, in_specs=(P(), P()), out_specs=(P(), P())),
          donate_argnums=(0,)).lower(state, total_like).compile()
    self._zeros = jax.jit(
        lambda scale, host: jnp.broadcast_to(
            jnp.concatenate([jnp.zeros(n, jnp.float32), scale[None], host]), (d, n + 1 + k)),
        in_shardings=self.meshes.local_replicated,
        out_shardings=self.meshes.local_by_device).lower(
            scalar, jax.ShapeDtypeStruct((k,), jnp.float32)).compile()

  def __call__(self, state: TrainState, pending: jax.Array | None, batch: dict[str, np.ndarray],
               example: dict[str, np.ndarray], key: jax.Array, step: int,
               first_block: int = 0, host_values: np.ndarray | None = None) -> Local:
    """Applies `pending`, then runs the host's share `batch` (possibly empty).

    `state` is this host's train state (replicated over its devices:
    `to_local_tree`); it is donated when `pending` (the last reduction's
    `Reduced.total`, or None) is applied. `example` is one record of the
    dataset; it fixes the micro-batch shapes even when this host's share is
    0. `key` is the run's base PRNG key; the step and each device's global
    block index (from `first_block`, the host's first block) are folded in
    on the devices. `host_values` (float32, the same length every call)
    ride along in the sums to the reduction, which gathers every host's.
    """
    host = np.zeros(0, np.float32) if host_values is None else (
        np.asarray(host_values, np.float32).ravel())
    if self._host_width is not None and host.size != self._host_width:
      raise ValueError(f"host_values has {host.size} values; this program was built for "
                       f"{self._host_width} (pass the same length every step).")
    if self._key is None or self._key[0] is not key:
      self._key = (key, jax.device_put(key, self.meshes.local_replicated))
    local_key = self._key[1]
    if self.layout is None:
      self._build(state, example, local_key, host.size)
    if pending is not None and self._update_then_grad is None:
      micro_like, total_like = self._abstract
      head = () if self.replica is not None else (state,)
      self._update_then_grad = self._fused_program.lower(
          *head, total_like, micro_like, local_key).compile()
    slot = self._calls % 2
    sums, first, lr = self._ring[slot], True, None
    d = self.meshes.local_devices
    for i, (micro, real) in enumerate(padded_chunks(batch, self.micro)):
      # Position, mask and host vector ride in the batch's one transfer.
      micro[_POSITION] = _position_rows(step, first_block + i * d, first, real, self.per_device,
                                        d, host)
      micro = jax.device_put(micro, self.meshes.local_by_device)
      if pending is not None and self.replica is not None:
        state, sums = self._update_then_grad(pending, micro, local_key)
        pending = None
      elif pending is not None:
        state, lr, sums = self._update_then_grad(state, pending, micro, local_key)
        pending = None
      else:
        if sums is None or sums.is_deleted():
          sums = self._zeros(state.loss_scale.scale, host)
        sums = self._grad(state, sums, micro, local_key)
      first = False
    if pending is not None:  # No micro-batch: the update alone.
      state, lr = self.update(state, pending)
    if first:  # No micro-batch: the recycled buffer still holds old sums.
      sums = self._zeros(state.loss_scale.scale, host)
    self._ring[slot] = sums
    self._calls += 1
    return Local(state, LocalSums(sums, self.layout), lr)

  def update(self, state: TrainState, pending: Any) -> tuple[TrainState, jax.Array | None]:
    """Applies a pending update alone: (the new state, its learning rate or NaN); donates `state`.

    Under the sharded update it only unpacks the new state (None: the
    reduction already reported the learning rate).
    """
    if self._unpack is not None:
      return self._unpack(pending), None
    return self._update_alone(state, pending)


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


def apply_update(optimizer: optax.GradientTransformation, state: TrainState, total: jax.Array,
                 layout: Layout) -> tuple[TrainState, jax.Array]:
  """`sum(grad sums) / sum(weights)`, the optax update, the weighted model state.

  `total` is the sums row added over every device (`Reduced.total`). On an
  fp16 overflow (`overflowed`) the update is skipped and the loss scale
  halved, the same on every host. Also returns the update's learning rate
  (NaN when the optimizer hides it).
  """
  return optimizer_step(optimizer, state, summed_row(total, layout), layout)


def optimizer_step(optimizer: optax.GradientTransformation, state: Any, total: jax.Array,
                   layout: Layout, view: Callable[[jax.Array], jax.Array] = lambda x: x
                   ) -> tuple[Any, jax.Array]:
  """The one update rule, on a whole state or on its slices: (new state, learning rate).

  `state` is a `TrainState` or the sharded update's `Shards` (the same
  fields); `view` lays a summed gradient or model-state leaf out as the
  state's leaves are laid out (the sharded update passes its split), so
  both paths divide, update, average and skip an fp16 overflow alike.
  """
  overflow = overflowed(total, layout)
  totals = layout.sums.unpack({"float32": total})
  count = totals.count
  # count == 0 is reported by the trainer as an error; a zero total weight
  # leaves the gradient zero rather than NaN.
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  # Divided leaf by leaf, so XLA fuses each division into the optimizer's first pass.
  grads = jax.tree.map(lambda g, p: (view(g) / norm).astype(p.dtype), totals.grads, state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  safe = jnp.maximum(count, 1.0)
  model_state = jax.tree.map(
      lambda old, s: jnp.where(count > 0, view(s) / safe, old).astype(old.dtype),
      state.model_state, totals.model_state)
  if precision_lib.uses_loss_scale(layout.precision):
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(overflow, b, a), new, old)
    params, opt_state, model_state = keep(
        (params, opt_state, model_state), (state.params, state.opt_state, state.model_state))
  lr = optimizers_lib.find_learning_rate(opt_state)
  lr = jnp.float32(jnp.nan) if lr is None else jnp.asarray(lr, jnp.float32)
  loss_scale = precision_lib.next_scale(state.loss_scale, overflow, layout.precision)
  return state._replace(step=state.step + 1, params=params, opt_state=opt_state,
                        model_state=model_state, loss_scale=loss_scale), lr


def summed_row(total: jax.Array, layout: Layout) -> jax.Array:
  """The `[n]` sums of a `Reduced.total` (a one-device world's is its `[1, n + 1 + k]` row)."""
  return total[0, :layout.row_size] if total.ndim == 2 else total


def overflowed(total: jax.Array, layout: Layout) -> jax.Array:
  """fp16: some sum is not finite (a host's, or the sum of all: the same step skipped
  everywhere); always False when the loss is not scaled."""
  if not precision_lib.uses_loss_scale(layout.precision):
    return jnp.bool_(False)
  return ~jnp.all(jnp.isfinite(total))


def step_stats(total: jax.Array, scale: jax.Array, layout: Layout) -> dict[str, jax.Array]:
  """A step's global statistics from `total` and the loss scale it ran with."""
  totals = layout.sums.unpack({"float32": total})
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  stats = {"count": totals.count, "loss": totals.loss / norm}
  stats.update({k: v / norm for k, v in totals.metrics.items()})
  if precision_lib.uses_loss_scale(layout.precision):
    stats.update(loss_scale=scale, skipped=overflowed(total, layout).astype(jnp.float32))
  return stats


def stat_names(layout: Layout) -> tuple[str, ...]:
  """The names of `step_stats`, in the order a `Reduced.report` holds them."""
  total = jax.ShapeDtypeStruct((layout.row_size,), jnp.float32)
  return tuple(jax.eval_shape(lambda t: step_stats(t, jnp.float32(1.0), layout), total))


def _report(stats: dict[str, jax.Array], names: tuple[str, ...], rows: jax.Array | None = None):
  """The statistics, then the rows, as one float32 vector: the step's one fetch."""
  values = jnp.stack([stats[k].astype(jnp.float32) for k in names])
  return values if rows is None else jnp.concatenate([values, rows.ravel()])


class Reduced(NamedTuple):
  """A dispatched reduction: the summed row for the next update, and what to fetch.

  Fetching the report is the step's only wait for the devices; the trainer
  does it after dispatching the next step, so the devices never idle while
  Python prepares it (a plain JAX loop reads its loss one step late for the
  same reason). One array: each fetch of a not-yet-ready array costs the
  waiting thread CPU that, on XLA:CPU, the step's own threads want.
  """

  report: jax.Array        # `names`' values, then (device backend) every device's host vector
  names: tuple[str, ...]
  rows: np.ndarray | None  # every host's vector `[hosts, k]`, when already in host memory
  meshes: Meshes          # picks each host's first row out of the report's `[all devices, k]`
  # The summed row, on this host's devices: the next step's program applies it.
  # A one-device world's is its local sums array `[1, n + 1 + k]` as it is:
  # summing over one device would only copy the row (ResNet-18's reduction
  # alone: 0.86 -> 0.29 ms). Under the sharded update, the new state packed
  # (`hetjax.sharding`): the next step's program unpacks it.
  total: Any
  shards: Any = None                     # the sharded update's new `Shards`
  learning_rate: jax.Array | None = None  # of the update the reduction applied (sharded)

  def fetch(self) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the step's global statistics, every host's row `[hosts, k]`); waits."""
    values = np.asarray(self.report)
    m = len(self.names)
    stats = dict(zip(self.names, values[:m]))
    if self.rows is not None:
      return stats, self.rows
    return stats, rows_by_host(values[m:].reshape(self.meshes.world.devices.size, -1), self.meshes)


class DeviceReduction:
  """One small global program over every device: NCCL on GPU, gloo on CPU.

  The fastest choice when every host's accelerators can join one collective
  (one GPU vendor and a working NCCL/RCCL across the job).
  """

  name = "device"

  def __init__(self, meshes: Meshes):
    self.meshes = meshes
    self._program = None
    self.sharded = None

  @property
  def shard_mesh(self) -> tuple[Mesh, str]:
    """Where the sharded update splits the state: every device of every host."""
    return self.meshes.world, ALL

  def attach(self, sharded) -> None:
    """Runs `sharded` (a `hetjax.sharding.ShardedUpdate`) inside the reduction's program."""
    self.sharded = sharded

  def _build(self, layout: Layout) -> None:
    n = layout.row_size

    self._names = names = stat_names(layout)
    sharded = self.sharded

    def program(world):
      sums, scale, rows = world[:, :n], world[0, n], world[:, n + 1:]
      total = jnp.sum(sums, axis=0)
      return total, _report(step_stats(total, scale, layout), names, rows)

    def sharded_program(world, shards):
      # Reduce, update each slice once, gather: one program, one collective pass.
      total, report = program(world)
      new, packed, lr = sharded.update(shards, total, layout)
      return new, packed, report, lr

    report_only = lambda world: program(world)[1]
    if sharded is not None:
      rep = self.meshes.replicated
      self._program = jax.jit(sharded_program, out_shardings=(sharded.shardings, rep, rep, rep),
                              donate_argnums=(1,))
    else:
      self._program = jax.jit(report_only if self.meshes.one_device else program,
                              out_shardings=self.meshes.replicated)

  def __call__(self, sums: LocalSums, shards=None) -> Reduced:
    """Reduces, without waiting: the summed row and what to fetch later (every
    device's host vector). With the sharded update attached, `shards` are
    updated too (donated) and `total` is the packed new state."""
    if self._program is None:
      self._build(sums.layout)
    if self.sharded is not None:
      new, packed, report, lr = self._program(to_world(sums.flat, self.meshes), shards)
      return Reduced(report, self._names, None, self.meshes,
                     self.sharded.to_local(packed, self.meshes), new, lr)
    if self.meshes.one_device:  # The row is the total: only the statistics to compute.
      return Reduced(self._program(sums.flat), self._names, None, self.meshes, sums.flat)
    total, report = self._program(to_world(sums.flat, self.meshes))
    return Reduced(report, self._names, None, self.meshes, to_local(total, self.meshes))


class HostReduction:
  """Sums moved to host memory and reduced with CPU collectives (gloo).

  For jobs whose hosts cannot share one device collective (accelerators of
  different vendors or generations whose collective libraries do not
  interoperate): the CPU collective does not care what accelerator a host
  has. Each host first sums over its own devices, on the devices, then
  copies that one row to host memory: one device-to-host copy per step.
  """

  name = "host"

  def __init__(self, meshes: Meshes):
    self.meshes = meshes
    cpus = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    firsts = [next(d for d in cpus if d.process_index == h) for h in range(meshes.num_hosts)]
    self._cpu_mesh = Mesh(np.array(firsts), ("host",))
    self._by_host = NamedSharding(self._cpu_mesh, P("host"))
    self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(self._cpu_mesh, P()))
    self._device_sum = None
    self.sharded = None
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

  @property
  def shard_mesh(self) -> tuple[Mesh, str]:
    """Where the sharded update splits the state: one CPU device per host."""
    return self._cpu_mesh, "host"

  def attach(self, sharded) -> None:
    """Runs `sharded` (a `hetjax.sharding.ShardedUpdate`) in the CPU program."""
    self.sharded = sharded

  def _build(self, layout: Layout) -> None:
    n = layout.row_size
    # The host's sums over its devices, then its scale and host vector (every device holds them).
    self._device_sum = jax.jit(lambda x: jnp.concatenate([jnp.sum(x[:, :n], axis=0), x[0, n:]]),
                               out_shardings=self.meshes.local_replicated)

    def reduce(x):  # [hosts, n + 1 + k] -> (the sum of the sums, every host's values)
      return jnp.sum(x[:, :n], axis=0), x[:, n:]

    on_cpus = NamedSharding(self._cpu_mesh, P())
    self._reduce = jax.jit(reduce, out_shardings=on_cpus)
    sharded = self.sharded
    if sharded is not None:
      def reduce_update(x, shards):  # Each host's CPU updates its slice; the slices gathered.
        total, rows = reduce(x)
        new, packed, lr = sharded.update(shards, total, layout)
        return new, packed, total, rows, lr
      self._reduce_update = jax.jit(
          reduce_update, out_shardings=(sharded.shardings, on_cpus, on_cpus, on_cpus, on_cpus),
          donate_argnums=(1,))
    self._names = names = stat_names(layout)
    self._stats = jax.jit(lambda total, scale: _report(step_stats(total, scale, layout), names),
                          out_shardings=self.meshes.local_replicated)

  def __call__(self, sums: LocalSums, shards=None) -> Reduced:
    """Reduces on the CPUs; same contract as `DeviceReduction`.

    The CPU collective needs this host's sums in host memory, so this
    backend waits for the local programs.
    """
    layout = sums.layout
    if self._device_sum is None:
      self._build(layout)
    # Summed over this host's devices on the devices; then one device-to-host copy.
    mine = np.asarray(self._device_sum(sums.flat).addressable_data(0))
    laid = jax.make_array_from_process_local_data(self._by_host, mine[None])
    if self.sharded is not None:
      new, packed, summed, rows, lr = self._reduce_update(laid, shards)
      packed, summed, rows = jax.device_get((packed, summed, rows))
      local = {g: jax.device_put(x, self.meshes.local_replicated) for g, x in packed.items()}
      total = jax.device_put(summed, self.meshes.local_replicated)
      return Reduced(self._stats(total, rows[0, 0]), self._names, rows[:, 1:], self.meshes,
                     local, new, lr)
    summed, rows = jax.device_get(self._reduce(laid))
    total = jax.device_put(summed, self.meshes.local_replicated)
    # rows: [hosts, scale and host vector]; every host ran with host 0's scale.
    return Reduced(self._stats(total, rows[0, 0]), self._names, rows[:, 1:], self.meshes,
                   sums.flat if self.meshes.one_device else total)


REDUCTIONS = {"device": DeviceReduction, "host": HostReduction}


def make_reduction(name: str, meshes: Meshes):
  """The cross-host reduction backend called `name` ('device' or 'host')."""
  if name not in REDUCTIONS:
    raise ValueError(f"unknown reduction backend {name!r}; choose 'device' or 'host'.")
  return REDUCTIONS[name](meshes)
