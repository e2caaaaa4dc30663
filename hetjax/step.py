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
(timings, config hashes): each device row of host `h` holds host `h`'s
values, so every host learns every host's values from the same collective
(invariant 3).
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

from hetjax.task import MASK, Task, split_losses

PyTree = Any
DEV = "dev"   # axis of the local mesh: this host's devices
ALL = "all"   # axis of the global mesh: every device of every host


class TrainState(NamedTuple):
  """Everything the optimizer carries, as global replicated arrays."""

  step: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree


class Sums(NamedTuple):
  """Per-device running sums; every leaf has a leading per-device axis."""

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
  hosts = meshes.row_hosts()
  return np.stack([rows[np.argmax(hosts == h)] for h in range(meshes.num_hosts)])


def micro_batches(batch: dict[str, np.ndarray], size: int) -> Iterator[dict[str, np.ndarray]]:
  """Cuts a batch into `size`-row chunks with a `MASK`, the last one padded.

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
    part[MASK] = (np.arange(size) < real).astype(np.float32)
    yield part


class LocalProgram:
  """Accumulates this host's gradient sums over its micro-batches."""

  def __init__(self, task: Task, meshes: Meshes, microbatch_per_device: int):
    if microbatch_per_device < 1:
      raise ValueError(f"--microbatch must be >= 1, got {microbatch_per_device}.")
    self.meshes = meshes
    self.micro = microbatch_per_device * meshes.local_devices
    mesh = meshes.local

    def per_device(params, model_state, sums, batch, key, step, first_block):
      # Without the cast, grad of a replicated input would already be summed
      # over the local devices; per-device sums let one reduction do it all.
      params = jax.lax.pcast(params, DEV, to="varying")
      block = first_block + jax.lax.axis_index(DEV)
      rng = jax.random.fold_in(jax.random.fold_in(key, step), block)
      real = batch[MASK] > 0
      masked_sum = lambda v: jnp.sum(jnp.where(real, v, 0.0))
      # An all-padding block (a host whose blocks do not fill its last device
      # round) shows the model an all-ones mask: masked BatchNorm over zero
      # rows would be NaN, and NaN survives `where` in the backward pass. Its
      # rows are copies of a real row, and every sum below uses `real`.
      model_batch = {**batch, MASK: jnp.where(jnp.any(real), batch[MASK], 1.0)}

      def total_loss(p):
        losses, metrics, new_state = task.loss(p, model_state, model_batch, rng)
        values, weights = split_losses(losses)
        weight = masked_sum(weights) if weights is not None else jnp.sum(real.astype(jnp.float32))
        return masked_sum(values), (metrics, new_state, weight)

      (loss, (metrics, new_state, weight)), grads = jax.value_and_grad(
          total_loss, has_aux=True)(params)
      n = jnp.sum(real.astype(jnp.float32))
      weighted_state = jax.tree.map(lambda s: jnp.where(n > 0, s * n, 0.0), new_state)
      add = lambda acc, x: acc + x[None].astype(acc.dtype)
      return Sums(
          grads=jax.tree.map(add, sums.grads, grads),
          weight=add(sums.weight, weight),
          count=add(sums.count, n),
          loss=add(sums.loss, loss),
          metrics={k: add(sums.metrics[k], masked_sum(v)) for k, v in metrics.items()},
          model_state=jax.tree.map(add, sums.model_state, weighted_state))

    self._accumulate = jax.jit(
        jax.shard_map(per_device, mesh=mesh,
                      in_specs=(P(), P(), P(DEV), P(DEV), P(), P(), P()), out_specs=P(DEV)),
        donate_argnums=(2,))
    self._batch_sharding = meshes.local_by_device
    self._task = task
    self._zeros = None
    self._key = None

  def _build_zeros(self, params, model_state, batch, rng) -> None:
    """Compiles the maker of zero sums, shaped like the local program's outputs."""
    per_device = {k: v[:self.micro // self.meshes.local_devices] for k, v in batch.items()}
    _, metrics, new_state = jax.eval_shape(self._task.loss, params, model_state, per_device, rng)
    d = self.meshes.local_devices
    zeros = lambda s: jnp.zeros((d,) + tuple(s.shape), jnp.float32)
    shapes = (params, metrics, new_state)
    sharding = self.meshes.local_by_device

    def make(params, metrics, new_state):
      return Sums(grads=jax.tree.map(zeros, params), weight=jnp.zeros((d,)), count=jnp.zeros((d,)),
                  loss=jnp.zeros((d,)),
                  metrics={k: jnp.zeros((d,)) for k in metrics},
                  model_state=jax.tree.map(zeros, new_state))

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    self._zeros = jax.jit(lambda: make(*abstract), out_shardings=sharding)

  def __call__(self, params: PyTree, model_state: PyTree, batch: dict[str, np.ndarray],
               example: dict[str, np.ndarray], key: jax.Array, step: int,
               first_block: int = 0) -> Sums:
    """Runs the host's share `batch` (possibly empty) through the local program.

    `example` is one record of the dataset; it fixes the micro-batch shapes
    even when this host's share is 0. `key` is the run's base PRNG key; the
    step and each device's global block index (from `first_block`, the
    host's first block) are folded in on the devices.
    """
    params = jax.tree.map(lambda x: to_local(x, self.meshes), params)
    model_state = jax.tree.map(lambda x: to_local(x, self.meshes), model_state)
    if self._key is None or self._key[0] is not key:
      self._key = (key, jax.device_put(key, self.meshes.local_replicated))
    local_key = self._key[1]
    if self._zeros is None:
      self._build_zeros(params, model_state, next(micro_batches(example, self.micro)), local_key)
    sums = self._zeros()
    step = np.int32(step)
    d = self.meshes.local_devices
    for i, micro in enumerate(micro_batches(batch, self.micro)):
      micro = jax.device_put(micro, self._batch_sharding)
      sums = self._accumulate(params, model_state, sums, micro, local_key, step,
                              np.int32(first_block + i * d))
    return sums




# ---- Cross-host reduction and update ------------------------------------


def init_state(task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               example_batch: dict[str, np.ndarray], seed: int) -> TrainState:
  """Initialises the train state as global replicated arrays (same on every host)."""

  def init(seed, batch):
    params, model_state = task.init(jax.random.key(seed), batch)
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), model_state)

  return jax.jit(init, out_shardings=meshes.replicated)(np.int32(seed), example_batch)


def _total(sums: Sums) -> Sums:
  return jax.tree.map(lambda x: jnp.sum(x, axis=0), sums)


def _update(optimizer: optax.GradientTransformation, state: TrainState,
            totals: Sums) -> tuple[TrainState, dict[str, jax.Array]]:
  """`sum(grad sums) / sum(weights)`, the optax update, and the weighted model state."""
  count = totals.count
  # count == 0 is reported by the trainer as an error; a zero total weight
  # leaves the gradient zero rather than NaN.
  norm = jnp.where(totals.weight != 0, totals.weight, 1.0)
  grads = jax.tree.map(lambda g, p: (g / norm).astype(p.dtype), totals.grads, state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  safe = jnp.maximum(count, 1.0)
  model_state = jax.tree.map(
      lambda old, s: jnp.where(count > 0, s / safe, old).astype(old.dtype),
      state.model_state, totals.model_state)
  stats = {"count": count, "loss": totals.loss / norm}
  stats.update({k: v / norm for k, v in totals.metrics.items()})
  return TrainState(state.step + 1, params, opt_state, model_state), stats


class DeviceReduction:
  """One fused global program over every device: NCCL on GPU, gloo on CPU.

  The fastest choice when every host's accelerators can join one collective
  (one GPU vendor and a working NCCL/RCCL across the job).
  """

  name = "device"

  def __init__(self, optimizer: optax.GradientTransformation, meshes: Meshes):
    self.meshes = meshes

    def program(state, sums, rows):
      new_state, stats = _update(optimizer, state, _total(sums))
      return new_state, stats, rows

    self._program = jax.jit(program, out_shardings=meshes.replicated, donate_argnums=(0,))

  def __call__(self, state: TrainState, sums: Sums,
               host_values: np.ndarray) -> tuple[TrainState, dict[str, jax.Array], np.ndarray]:
    """Reduces, updates; returns the new state, the stats and every host's values."""
    world = jax.tree.map(lambda x: to_world(x, self.meshes), sums)
    state, stats, rows = self._program(state, world, host_rows(host_values, self.meshes))
    stats, rows = jax.device_get((stats, rows))  # One host sync for both.
    return state, stats, rows_by_host(rows, self.meshes)


class HostReduction:
  """Sums moved to host memory and reduced with CPU collectives (gloo).

  For jobs whose hosts cannot share one device collective (accelerators of
  different vendors or generations whose collective libraries do not
  interoperate): the CPU collective does not care what accelerator a host
  has. It costs a device-to-host copy of the gradients each step.
  """

  name = "host"

  def __init__(self, optimizer: optax.GradientTransformation, meshes: Meshes):
    self.meshes = meshes
    cpus = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))
    firsts = [next(d for d in cpus if d.process_index == h) for h in range(meshes.num_hosts)]
    self._cpu_mesh = Mesh(np.array(firsts), ("host",))
    self._by_host = NamedSharding(self._cpu_mesh, P("host"))
    self._reduce = jax.jit(lambda x: jax.tree.map(lambda a: jnp.sum(a, axis=0), x),
                           out_shardings=NamedSharding(self._cpu_mesh, P()))
    self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(self._cpu_mesh, P()))
    self._update = jax.jit(lambda state, totals: _update(optimizer, state, totals),
                           out_shardings=meshes.replicated, donate_argnums=(0,))
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

  def __call__(self, state: TrainState, sums: Sums,
               host_values: np.ndarray) -> tuple[TrainState, dict[str, jax.Array], np.ndarray]:
    """Reduces on the CPUs, updates on the devices; same contract as `DeviceReduction`."""
    host_sums = jax.tree.map(lambda x: np.sum(np.asarray(x), axis=0, keepdims=True), sums)
    to_cpu = lambda x: jax.make_array_from_process_local_data(self._by_host, x)
    totals = jax.device_get(self._reduce(jax.tree.map(to_cpu, host_sums)))
    rows = np.asarray(self._gather(to_cpu(np.asarray(host_values, np.float32).reshape(1, -1))))
    replicated = self.meshes.replicated
    totals = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x), totals)
    state, stats = self._update(state, totals)
    return state, jax.device_get(stats), rows


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
