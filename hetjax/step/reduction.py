"""The cross-host reduction: every device's row summed, the step's statistics, the sharded update."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax.mesh import (ALL, HOSTS, Meshes, gather_host_values, rows_by_host, to_local,
                         to_world)
from hetjax.step.state import Layout, LocalSums
from hetjax.step.update import stat_names, step_stats


def _report(stats: dict[str, jax.Array], names: tuple[str, ...], rows: jax.Array | None = None):
  """The statistics, then the rows, as one float32 vector: the step's one fetch."""
  values = jnp.stack([stats[k].astype(jnp.float32) for k in names])
  return values if rows is None else jnp.concatenate([values, rows.ravel()])


class Reduced(NamedTuple):
  """A dispatched reduction: the summed row for the next update, and what to fetch.

  The report's fetch is the step's only wait, done after dispatching the next step so devices
  never idle. One array: each fetch of an unready array costs CPU the XLA:CPU step wants.
  """

  report: jax.Array        # `names`' values, then (device backend) every device's host vector
  names: tuple[str, ...]
  rows: np.ndarray | None  # every host's vector `[hosts, k]`, when already in host memory
  meshes: Meshes          # picks each host's first row out of the report's `[all devices, k]`
  # The summed row on this host's devices (a one-device world's `[1, n + 1 + k]` sums as they
  # are: ResNet-18's reduction 0.86 -> 0.29 ms); under the sharded update the packed new state.
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
    self.sharded = None  # A `ShardedUpdate` set here runs inside the reduction's program.

  @property
  def shard_mesh(self) -> tuple[Mesh, str]:
    """Where the sharded update splits the state: every device of every host."""
    return self.meshes.world, ALL

  def _build(self, layout: Layout) -> None:
    n = layout.row_size

    self._names = names = stat_names(layout)
    sharded = self.sharded

    def program(world):
      sums, scale, rows = world[:, :n], world[0, n], world[:, n + 1:]
      total = jnp.sum(sums, axis=0)
      return total, _report(step_stats(total, scale, layout), names, rows)

    def sharded_program(world, shards):
      # Reduce-scatter, update each slice once, gather: one program, one collective pass.
      new, packed, stats, rows, lr = sharded.reduce_update(world, shards, layout)
      return new, packed, _report(stats, names, rows[:, 1:]), lr

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

  For hosts that share no device collective (vendors or generations whose libraries do not
  interoperate). Each host sums over its devices first: one device-to-host copy per step.
  """

  name = "host"

  def __init__(self, meshes: Meshes):
    check_values_over_hosts(meshes, "the host reduction")
    self.meshes = meshes
    self._cpu_mesh = meshes.hosts
    self._by_host = NamedSharding(self._cpu_mesh, P(HOSTS))
    self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(self._cpu_mesh, P()))
    self._device_sum = None
    self.sharded = None  # A `ShardedUpdate` set here runs in the CPU program.
    line_up(self._gather, self._by_host, meshes)

  @property
  def shard_mesh(self) -> tuple[Mesh, str]:
    """Where the sharded update splits the state: one CPU device per host."""
    return self._cpu_mesh, HOSTS

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
    self._names = names = stat_names(layout)
    if sharded is not None:
      def reduce_update(x, shards):  # Each host's CPU updates its slice; the slices gathered.
        new, packed, stats, rows, lr = sharded.reduce_update(x, shards, layout)
        return new, packed, _report(stats, names), rows, lr
      self._reduce_update = jax.jit(
          reduce_update, out_shardings=(sharded.shardings, on_cpus, on_cpus, on_cpus, on_cpus),
          donate_argnums=(1,))
    self._stats = jax.jit(lambda total, scale: _report(step_stats(total, scale, layout), names),
                          out_shardings=self.meshes.local_replicated)

  def __call__(self, sums: LocalSums, shards=None) -> Reduced:
    """Reduces on the CPUs; same contract as `DeviceReduction`, but waits for the local
    programs (the CPU collective needs the sums in host memory)."""
    layout = sums.layout
    if self._device_sum is None:
      self._build(layout)
    # Summed over this host's devices on the devices; then one device-to-host copy.
    mine = np.asarray(self._device_sum(sums.flat).addressable_data(0))
    laid = jax.make_array_from_process_local_data(self._by_host, mine[None])
    if self.sharded is not None:
      new, packed, report, rows, lr = self._reduce_update(laid, shards)
      packed, rows = jax.device_get((packed, rows))
      local = {g: jax.device_put(x, self.meshes.local_replicated) for g, x in packed.items()}
      # This host's copy of the statistics (a one-device array: fetched later, like a device's).
      return Reduced(report.addressable_data(0), self._names, rows[:, 1:], self.meshes, local,
                     new, lr)
    summed, rows = jax.device_get(self._reduce(laid))
    total = jax.device_put(summed, self.meshes.local_replicated)
    # rows: [hosts, scale and host vector]; every host ran with host 0's scale.
    return Reduced(self._stats(total, rows[0, 0]), self._names, rows[:, 1:], self.meshes,
                   sums.flat if self.meshes.one_device else total)


def line_up(program: Any, by_host: NamedSharding, meshes: Meshes) -> None:
  """Runs `program` once on a `[hosts, 1]` probe with every host lined up first.

  gloo sets up a communicator on its first collective and gives up if a peer is not there
  within 30 s (fixed in XLA), so a host compiling much later would fail the first step. So:
  compile, line hosts up with a gather of host values (over these CPUs), run at once.
  """
  probe = jax.make_array_from_process_local_data(by_host, np.zeros((1, 1), np.float32))
  compiled = program.lower(probe).compile()
  gather_host_values(np.zeros(1), meshes)
  jax.block_until_ready(compiled(probe))


REDUCTIONS = {"device": DeviceReduction, "host": HostReduction}


def check_values_over_hosts(meshes: Meshes, what: str) -> None:
  """Refuses `what` (a CPU reduction) on meshes whose host values travel over the devices
  (their accelerators may share no collective: checks, votes and timings avoid them too)."""
  if meshes.values_over != "host":
    raise ValueError(f"{what} needs meshes whose host values travel over the CPUs too, got "
                     f"values_over={meshes.values_over!r}: build them with "
                     "Meshes.create('host') (the trainers do, from TrainConfig.reduction).")


def make_reduction(name: str, meshes: Meshes):
  """The cross-host reduction backend called `name` ('device' or 'host')."""
  if name not in REDUCTIONS:
    raise ValueError(f"unknown reduction backend {name!r}; choose 'device' or 'host'.")
  return REDUCTIONS[name](meshes)
