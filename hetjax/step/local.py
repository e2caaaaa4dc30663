"""`LocalProgram`: this host's share of a step, on its own devices only."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax.step import packing
from hetjax.step import precision as precision_lib
from hetjax.step import within_host as within_lib
from hetjax.mesh import DEV, Meshes
from hetjax.task import MASK, Task
from hetjax.step.state import Layout, LocalSums, Sums, TrainState
from hetjax.balancer.ladder import Ladder
from hetjax.step.block import block_sums, blocks_sums, micro_batches, pad_rows
from hetjax.step.update import apply_update


# Batch entry, one int32 row per device: step, the device's first block, first
# micro-batch?, real examples on the device, then the host vector's float32
# bits (`_position_rows`).
_POSITION = "hetjax.position"
_POSITION_FIELDS = 4

def _position_rows(step: int, first_block: int, first: bool, real: int, per_device: int,
                   devices: int, host_values: np.ndarray, blocks: int = 1) -> np.ndarray:
  """`_POSITION` of one micro-batch of `blocks` blocks per device: `[devices, 4 + k]` int32
  (device `d` runs blocks `first_block + d * blocks ...`)."""
  d, rows = np.arange(devices), blocks * per_device
  fields = np.stack([np.full(devices, step), first_block + d * blocks, np.full(devices, int(first)),
                     np.clip(real - d * rows, 0, rows)], axis=1)
  bits = np.broadcast_to(host_values.view(np.int32), (devices, host_values.size))
  return np.concatenate([fields.astype(np.int32), bits], axis=1)


class Local(NamedTuple):
  """One step's work on this host's devices."""

  state: TrainState                # this host's train state, the pending update applied
  sums: LocalSums
  learning_rate: jax.Array | None  # of the update applied (NaN if hidden); None: none was


class LocalProgram:
  """Applies the last step's update (or unpacks the sharded update's result, `replica`),
  then accumulates this host's gradient sums.

  Step `s`'s update runs inside step `s + 1`'s first micro-batch program: on XLA:CPU a separate
  update program's hundreds of small kernels cannot overlap the backward pass. With no
  micro-batch (a share of 0, a checkpoint, the end of `fit`) `update` applies it alone; every
  host applies every update, so replicas stay equal.

  With `device_batch = k` a micro-batch gives each device `k` whole blocks, kept apart
  (`blocks_sums`); a share runs as this host's ladder (`k, k/2, ..., 1`, what the balancer
  prices), all sizes compiled at the first call. A row's block index does not depend on `k`.
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               microbatch_per_device: int, precision: str = "fp32", blocks_full: bool = False,
               replica: packing.Packer | None = None, device_batch: int = 1,
               within: within_lib.Split | None = None):
    """`blocks_full`: no block of the run is part padding (see `block_sums`).

    `replica`: the sharded update's packing; a pending update is then the packed new state.
    `device_batch`: `k`, blocks per device in the largest micro-batch.
    `within`: split this host's parameters over its devices (`within_host`; needs `replica`).
    """
    if within is not None and replica is None:
      raise ValueError("within-host sharding needs the sharded update (more than one device "
                       "in the world); a world of one device has nothing to split over.")
    if microbatch_per_device < 1:
      raise ValueError(f"--microbatch must be >= 1, got {microbatch_per_device}.")
    if int(device_batch) < 1:
      raise ValueError(f"--device-batch must be >= 1 block per device, got {device_batch}.")
    self.meshes = meshes
    self.per_device = microbatch_per_device
    self.blocks_full = blocks_full
    self.micro = microbatch_per_device * meshes.local_devices
    self.device_batch = int(device_batch)
    self.ladder = Ladder.of(meshes.local_devices, self.device_batch)
    self.precision = precision_lib.check(precision)
    self.layout: Layout | None = None
    self._task, self._optimizer = task, optimizer
    self.replica, self.within = replica, within
    self._joined: tuple[TrainState, TrainState] | None = None
    # The sharded update's new state alone (a share of 0, a read of the state;
    # also before the first step, so not built with the other programs).
    self._unpack = None if replica is None else jax.jit(
        replica.unpack, out_shardings=meshes.local_replicated)
    if within is not None:
      self._whole_like = jax.eval_shape(replica.unpack, {
          g: jax.ShapeDtypeStruct((size,), jnp.dtype(g)) for g, size in replica.sizes.items()})
      self._state_specs = within.state_specs(self._whole_like)
      self._unpack = jax.jit(jax.shard_map(self._unpack_rows, mesh=meshes.local, in_specs=P(),
                                           out_specs=self._state_specs))
      self._join = jax.jit(jax.shard_map(
          lambda s: s._replace(params=within.join(s.params)), mesh=meshes.local,
          in_specs=(self._state_specs,), out_specs=P(), check_vma=False))
    self._key = None
    self._unsharded_peak: int | None = None
    # Sums buffers recycled from two steps back: the last step's may still be
    # read (by its reduction, or the thread that times it) while this one runs.
    self._ring: list[jax.Array | None] = [None, None]
    self._calls = 0
    self._host_width: int | None = None  # k: the host vector's length, fixed by the first call.
    self._grad: dict[int, Any] = {}             # blocks per device -> compiled program
    self._update_then_grad: dict[int, Any] = {}

  def _build(self, state: TrainState, example: dict[str, np.ndarray], rng: jax.Array,
             host_width: int) -> None:
    """Fixes the row layout and compiles the programs, once."""
    per_device = {k: v[:self.per_device] for k, v in
                  next(micro_batches(example, self.micro)).items()}
    within = self.within
    self._build_args = (example, rng, host_width)
    whole_params = state.params if within is None else within.like
    _, metrics, new_state = jax.eval_shape(self._task.loss, whole_params, state.model_state,
                                           per_device, rng)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    shapes = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    sums_like = Sums(shapes(whole_params), scalar, scalar, scalar, {k: scalar for k in metrics},
                     shapes(new_state))
    layout = self.layout = Layout(packing.Packer(sums_like, dtype=jnp.float32), self.precision)
    task, optimizer, n, m = self._task, self._optimizer, layout.row_size, self.per_device
    if within is not None:
      task = within.gathering(task)
      offsets = within_lib.grad_offsets(layout.sums, whole_params)
      rest = packing.Packer(tuple(sums_like)[1:], dtype=jnp.float32)

    def to_row(sums, scale, host, base):
      # One device's `[1, n + 1 + k]`: `base` (kept sums, or None: zeros) plus this
      # micro-batch's sums, the loss scale and host vector set in the tail.
      if within is None:
        row = jnp.concatenate([layout.sums.pack(sums)["float32"], scale[None], host])[None]
        return row if base is None else base + row
      base = jnp.zeros((1, n + 1 + host.size), jnp.float32) if base is None else base
      tail = jnp.concatenate([rest.pack(tuple(sums)[1:])["float32"], scale[None], host])
      base = base.at[0, n + 1 + host.size - tail.size:].add(tail)
      return within.place(base, sums.grads, offsets)

    def grad_row(state, buffer, batch, key):
      # Without the cast, grad of a replicated input would already be summed
      # over the local devices; per-device sums let one reduction do it all.
      params = within.varying(state.params) if within is not None else jax.lax.pcast(
          state.params, DEV, to="varying")
      batch = dict(batch)
      position = batch.pop(_POSITION)[0]
      step, block, first, real = (position[i] for i in range(_POSITION_FIELDS))
      host = jax.lax.bitcast_convert_type(position[_POSITION_FIELDS:], jnp.float32)
      j = len(next(iter(batch.values()))) // m  # Blocks on this device.
      scale = state.loss_scale.scale
      step_key = jax.random.fold_in(key, step)
      if j == 1:
        batch[MASK] = (jnp.arange(m) < real).astype(jnp.float32)
        sums = block_sums(task, params, state.model_state, batch, jax.random.fold_in(
            step_key, block), scale, self.precision, self.blocks_full)
      else:
        # Block i of the device: its own rows, real count, mask and key.
        blocks = {k: v.reshape((j, m) + v.shape[1:]) for k, v in batch.items()}
        reals = jnp.clip(real - jnp.arange(j) * m, 0, m)
        blocks[MASK] = (jnp.arange(m)[None] < reals[:, None]).astype(jnp.float32)
        keys = jax.vmap(lambda b: jax.random.fold_in(step_key, b))(block + jnp.arange(j))
        sums = blocks_sums(task, params, state.model_state, blocks, keys, scale, self.precision,
                           self.blocks_full)
      # The first micro-batch of a step starts from zero in a recycled buffer;
      # the scale and host vector are set, not summed. One elementwise pass, in place.
      if buffer is None:
        return to_row(sums, scale, host, None)
      keep = (first == 0) & (jnp.arange(buffer.shape[-1]) < n)
      return to_row(sums, scale, host, jnp.where(keep[None], buffer, 0.0))

    def accumulate(state, sums, batch, key):
      return grad_row(state, sums, batch, key)

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
    replicated = lambda shape, dtype: jax.ShapeDtypeStruct(
        shape, dtype, sharding=self.meshes.local_replicated)
    sums_like = jax.ShapeDtypeStruct((d, n + 1 + k), jnp.float32,
                                     sharding=self.meshes.local_by_device)
    total_like = sums_like if self.meshes.one_device else replicated((n,), jnp.float32)
    if replica is not None:
      total_like = {g: replicated((size,), jnp.dtype(g)) for g, size in replica.sizes.items()}
    one_row = {key: v[:1] for key, v in example.items()}
    self._micro_like = {}
    for j in self.ladder.sizes:
      micro = pad_rows(one_row, j * self.micro)
      micro[_POSITION] = _position_rows(0, 0, True, 0, m, d, np.zeros(k, np.float32), j)
      self._micro_like[j] = jax.tree.map(like, jax.device_put(micro, self.meshes.local_by_device))
    self._total_like = total_like
    # Every program is compiled at a step every host reaches, whatever its
    # share: the first call (and, for the update, the first with one pending).
    # A new share then compiles nothing on any host (invariant 4).
    state_spec, state_like = P(), state
    if within is not None:  # Parameters as rows, whatever placement `state` came in.
      state_spec = self._state_specs
      state_like = jax.tree.map(like, state)._replace(
          params=within.shapes(self.meshes.local))
    grad = jax.jit(jax.shard_map(accumulate, mesh=local,
                                 in_specs=(state_spec, P(DEV), P(DEV), P()), out_specs=P(DEV)),
                   donate_argnums=(1,))
    self._grad = {j: grad.lower(state_like, sums_like, self._micro_like[j], rng).compile()
                  for j in self.ladder.sizes}
    # Read once per program, off the step's path: what `flops_of` prices a share with.
    self._flops = {j: _flops(program, d) for j, program in self._grad.items()}
    if within is not None:  # Compiled now, so that `peak_bytes` reads it.
      self._unpack = self._unpack.lower(total_like).compile()
    elif replica is not None:
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

  def _unpack_rows(self, packed: Any) -> TrainState:
    """The sharded update's new state with this device's parameter slabs (in a `shard_map`)."""
    state = self.replica.unpack(packed)
    return state._replace(params=self.within.chunk(state.params))

  def joined(self, state: TrainState) -> TrainState:
    """`state` with whole parameters (replicated on this host's devices): itself unless
    within-host sharding keeps them as rows; then gathered, cached for this `state`."""
    if self.within is None:
      return state
    if self._joined is None or self._joined[0] is not state:
      self._joined = (state, self._join(state))
    return self._joined[1]

  def peak_bytes(self) -> int | None:
    """A device's peak bytes over a step (XLA's memory analysis; None if unknown)."""
    programs = [*self._grad.values(), *self._update_then_grad.values()]
    if self.within is not None and self.layout is not None:  # Compiled by `_build`.
      programs.append(self._unpack)
    peaks = [within_lib.peak_bytes(p) for p in programs]
    return None if not peaks or None in peaks else max(peaks)

  def unsharded_peak_bytes(self) -> int | None:
    """`peak_bytes` of this host's step without sharding within it: on a sharded host its
    programs compiled whole once, on demand (the figure to compare with); else `peak_bytes`."""
    if self.within is None or self.layout is None:
      return self.peak_bytes()
    if self._unsharded_peak is None:
      whole = LocalProgram(self._task, self._optimizer, self.meshes, self.per_device,
                           self.precision, self.blocks_full, self.replica, self.device_batch)
      state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=self.meshes.local_replicated), self._whole_like)
      whole._build(state, *self._build_args)
      rng = self._build_args[1]
      whole._update_then_grad = {j: whole._fused_program.lower(
          self._total_like, whole._micro_like[j], rng).compile() for j in self.ladder.sizes}
      self._unsharded_peak = whole.peak_bytes()
    return self._unsharded_peak

  def flops_of(self, rows: int) -> float | None:
    """FLOPs this host's devices run for a share of `rows` samples (XLA's cost analysis of the
    share's programs; None if unknown). The update's own FLOPs are left out (a small part)."""
    if not getattr(self, "_flops", None) or any(f is None for f in self._flops.values()):
      return None
    return float(sum(self._flops[j] for j in self.programs(rows)))

  def programs(self, rows: int) -> list[int]:
    """Blocks per device of each micro-batch a share of `rows` samples runs, largest first
    (`Ladder.programs`: what the balancer prices)."""
    blocks = -(-int(rows) // self.per_device)
    runs = self.ladder.programs(blocks)
    return [j for j in sorted(runs, reverse=True) for _ in range(runs[j])]

  def __call__(self, state: TrainState, pending: jax.Array | None, batch: dict[str, np.ndarray],
               example: dict[str, np.ndarray], key: jax.Array, step: int,
               first_block: int = 0, host_values: np.ndarray | None = None) -> Local:
    """Applies `pending`, then runs the host's share `batch` (possibly empty).

    `state` is donated when `pending` (`Reduced.total`, or None) is applied. `example` (one
    record) fixes the shapes even for a share of 0. `key`: the run's base key; the step and
    each block's global index (from `first_block`) are folded in. `host_values` (float32, same
    length every call) ride in the sums to the reduction.
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
    if pending is not None and self.within is not None:
      # Unpacked alone: inside the first micro-batch's program the whole packed
      # replica would be live beside the sums row and the activations.
      state, pending = self._unpack(pending), None
    if pending is not None and not self._update_then_grad:
      head = () if self.replica is not None else (state,)
      self._update_then_grad = {
          j: self._fused_program.lower(*head, self._total_like, self._micro_like[j],
                                       local_key).compile() for j in self.ladder.sizes}
    slot = self._calls % 2
    sums, first, lr = self._ring[slot], True, None
    d, m = self.meshes.local_devices, self.per_device
    rows = len(next(iter(batch.values()))) if batch else 0
    start = 0
    for j in self.programs(rows):
      size = j * self.micro
      micro = pad_rows({k: v[start:start + size] for k, v in batch.items()}, size)
      # Position, mask and host vector ride in the batch's one transfer.
      micro[_POSITION] = _position_rows(step, first_block + start // m, first,
                                        min(size, rows - start), m, d, host, j)
      micro = jax.device_put(micro, self.meshes.local_by_device)
      if pending is None:
        if sums is None or sums.is_deleted():
          sums = self._zeros(state.loss_scale.scale, host)
        sums = self._grad[j](state, sums, micro, local_key)
      elif self.replica is not None:
        state, sums = self._update_then_grad[j](pending, micro, local_key)
      else:
        state, lr, sums = self._update_then_grad[j](state, pending, micro, local_key)
      first, pending = False, None
      start += size
    if pending is not None:  # No micro-batch: the update alone.
      state, lr = self.update(state, pending)
    if first:  # No micro-batch: the recycled buffer still holds old sums.
      sums = self._zeros(state.loss_scale.scale, host)
    self._ring[slot] = sums
    self._calls += 1
    return Local(state, LocalSums(sums, self.layout), lr)

  def update(self, state: TrainState, pending: Any) -> tuple[TrainState, jax.Array | None]:
    """Applies a pending update alone: (the new state, its learning rate or NaN); donates `state`.
    Under the sharded update it only unpacks the new state (None: the reduction reported it)."""
    if self._unpack is not None:
      return self._unpack(pending), None
    return self._update_alone(state, pending)


def _flops(compiled: Any, devices: int) -> float | None:
  """FLOPs of one run of a compiled program over all `devices` (XLA counts one device's)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # noqa: BLE001 (a backend without cost analysis: the figure is unknown)
    return None
  if isinstance(cost, (list, tuple)):  # Older JAX: one dict per program.
    cost = cost[0] if cost else None
  flops = (cost or {}).get("flops")
  return None if flops is None or flops < 0 else float(flops) * devices
