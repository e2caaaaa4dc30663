"""What a round of hybrid and of elastic share.

A round, on every host:
1. `taus`: how many local steps each host runs (fixed, or from the hosts'
   measured local step times, which every host holds the same copy of);
2. `RoundData`: the round takes the next `sum(tau) * b` positions of the
   one global stream; host i the contiguous slice after hosts `< i`, cut
   into its `tau_i` local steps of `b` positions;
3. `LocalStep`: each local step runs on this host's devices only (one
   program: blocks of `m` positions per device, the inner optax update);
   no cross-host collective, so hosts run different numbers of them;
4. `RoundReduction`: one reduction that every host joins, summing a
   per-host tree and gathering every host's small vector of timings.

A block's key is `fold_in(fold_in(key(seed), round), block)`, `block`
counting the round's blocks in stream order (as the sync step counts a
step's), so with one local step per host a round is a sync step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from hetjax import blocks as blocks_lib
from hetjax.balancer import taus_from_speeds  # noqa: F401 (numpy only, shared with the simulator)
from hetjax.balancer.ladder import Ladder
from hetjax.step import precision as precision_lib
from hetjax import mesh as mesh_lib
from hetjax import step as step_lib
from hetjax.step.reduction import check_values_over_hosts
from hetjax.mesh import DEV, Meshes
from hetjax.task import MASK, Task

PyTree = Any
WARMUP_ROUNDS = 2   # Rounds run with tau = 1 while the hosts' speeds are measured.
SPEED_WINDOW = 8    # Rounds of local step times whose median sets the speeds.


# ---- 1. Local steps per host ---------------------------------------------


class TauPolicy:
  """Fixed counts, or counts from the hosts' measured seconds per local step.

  Every host feeds `observe` the same gathered vector, so every host gets
  the same taus. The first `WARMUP_ROUNDS` rounds (compilation, first
  transfers) run one local step per host and are not measured; later the
  median over the last `SPEED_WINDOW` rounds sets the speeds.
  """

  def __init__(self, round_steps: int, num_hosts: int, fixed: Sequence[int] | None = None):
    self.round_steps, self.num_hosts = int(round_steps), int(num_hosts)
    self.fixed = None if fixed is None else tuple(int(t) for t in fixed)
    self._seconds: list[list[float]] = []  # [rounds][hosts], per local step
    self._round = 0

  def taus(self, round_index: int) -> tuple[int, ...]:
    if self.fixed is not None:
      return self.fixed
    if not self._seconds:
      return (1,) * self.num_hosts
    return taus_from_speeds(self.round_steps, np.median(self._seconds[-SPEED_WINDOW:], axis=0))

  def observe(self, round_index: int, step_s: Sequence[float]) -> None:
    if round_index + 1 >= WARMUP_ROUNDS:
      self._seconds.append([float(s) for s in step_s])
      del self._seconds[:-SPEED_WINDOW]

  def state_dict(self) -> dict[str, Any]:
    return {"seconds": self._seconds}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    seconds = state.get("seconds", [])
    if seconds and len(seconds[0]) != self.num_hosts:
      return  # Another host count: measure afresh.
    self._seconds = [list(map(float, s)) for s in seconds]


# ---- 2. The round's data ---------------------------------------------------


class RoundData:
  """Stream positions of a round: host i's local step k, and the block it starts at."""

  def __init__(self, start: int, taus: Sequence[int], local_batch: int, block: int):
    self.start, self.taus, self.b, self.block = int(start), tuple(taus), int(local_batch), int(block)

  @property
  def size(self) -> int:
    """Positions the round consumes: every host's local steps of `b`."""
    return sum(self.taus) * self.b

  def samples(self) -> tuple[int, ...]:
    """`n_i`, samples each host processes this round."""
    return tuple(t * self.b for t in self.taus)

  def host_positions(self, host: int) -> np.ndarray:
    """Host `host`'s contiguous slice of the round's positions, all its local steps."""
    first = self.start + sum(self.taus[:host]) * self.b
    return first + np.arange(self.taus[host] * self.b, dtype=np.int64)

  def first_block(self, host: int, local_step: int) -> int:
    """The round-wide index of the first block of the host's local step."""
    per_step = blocks_lib.num_blocks(self.b, self.block)
    return (sum(self.taus[:host]) + local_step) * per_step


def read(source: Any, sampler: Any, positions: np.ndarray, augment: Callable | None) -> dict:
  """Records at stream `positions`, augmented by record (as `hetjax.input.loader` does)."""
  from hetjax.input import augment as augment_lib
  indices = sampler.at(positions)
  batch = source[indices]
  if augment is not None:
    epochs = positions // sampler.num_records
    batch = augment(batch, augment_lib.example_keys(sampler.seed, epochs, indices))
  return batch


# ---- 3. A local step on this host's devices --------------------------------


class LocalStep:
  """One local step: `b` samples in blocks on this host's devices, then the inner update.

  One compiled program per step: each device scans over its blocks
  (device j of micro-round r runs block `first + r * d + j`), the sums meet
  in a psum over this host's devices only, and the inner optax update
  follows. With a device batch `k` a device runs `k` micro-rounds' blocks at
  once (`blocks_sums`, each block still its own), the rest through the
  ladder's smaller sizes: the same blocks, keys and sums. Parameters and inner
  state are arrays on this host's devices (the local mesh).

  Precision as in the sync step (`hetjax.step.precision`). Under fp16 each host
  keeps its own dynamic loss scale in its inner state: a local step whose
  gradients overflow is skipped on that host alone and its scale halved.
  No other host needs to know: the round's reduction sums models, not
  gradients, and a skipped step leaves the host's model where it was.
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation, meshes: Meshes,
               microbatch: int, local_batch: int, precision: str = "fp32",
               device_batch: int = 1):
    self.meshes, self.m, self.b = meshes, int(microbatch), int(local_batch)
    self.precision = precision_lib.check(precision)
    d = meshes.local_devices
    self.micro_rounds = -(-blocks_lib.num_blocks(self.b, self.m) // d)
    # Device batches: rounds in runs of k (and the ladder's smaller ones).
    self.device_batch = int(device_batch)
    self.ladder = Ladder.of(d, self.device_batch)
    self.optimizer = optimizer

    self.task = task
    self._step = None
    # The host's inner state: the optimizer's, and its own loss scale (fp16).
    init = lambda p: (optimizer.init(p), precision_lib.initial_scale(precision))
    self._init_opt = jax.jit(init, out_shardings=meshes.local_replicated)
    self._key = None

  def _build(self, metric_names: Sequence[str]) -> None:
    """Compiles the step; the metric names fix the shape of the running sums."""
    task, optimizer, meshes, d = self.task, self.optimizer, self.meshes, self.meshes.local_devices
    precision = self.precision
    scaled = precision_lib.uses_loss_scale(precision)
    blocks_full = blocks_lib.every_block_whole(self.b, self.m)

    def per_device(params, model_state, scale, batch, key, round_index, first_block):
      params = jax.lax.pcast(params, DEV, to="varying")
      batch = jax.tree.map(lambda x: x[0], batch)   # [micro_rounds, m, ...]
      device = jax.lax.axis_index(DEV)

      def add(carry, b):
        sums = {"grads": b.grads, "weight": b.weight, "count": b.count, "loss": b.loss,
                "metrics": {k: b.metrics[k] for k in metric_names},
                "model_state": b.model_state}
        return jax.tree.map(lambda a, x: a + x.astype(a.dtype), carry, sums)

      def one_block(carry, xs):
        block, r = xs
        rng = jax.random.fold_in(jax.random.fold_in(key, round_index), first_block + r * d + device)
        return add(carry, step_lib.block_sums(task, params, model_state, block, rng, scale,
                                              precision, blocks_full)), None

      def rounds_of(carry, xs):
        # `j` micro-rounds at once: the device's `j` blocks stay separate blocks.
        blocks, r = xs  # [j, m, ...], the first round's index
        j = len(blocks[MASK])
        keys = jax.vmap(lambda g: jax.random.fold_in(jax.random.fold_in(key, round_index), g))(
            first_block + (r + jnp.arange(j)) * d + device)
        return add(carry, step_lib.blocks_sums(task, params, model_state, blocks, keys, scale,
                                               precision, blocks_full)), None

      zero = lambda x: jax.lax.pcast(jnp.zeros(jnp.shape(x), jnp.float32), DEV, to="varying")
      init = {"grads": jax.tree.map(zero, params), "weight": zero(0.0), "count": zero(0.0),
              "loss": zero(0.0), "metrics": {k: zero(0.0) for k in metric_names},
              "model_state": jax.tree.map(zero, model_state)}
      if self.device_batch == 1:
        sums, _ = jax.lax.scan(one_block, init, (batch, jnp.arange(self.micro_rounds)))
        return jax.lax.psum(sums, DEV)
      # The ladder's decomposition of the rounds: full runs of k in a scan, the rest unrolled.
      runs, k, start = self.ladder.decompose(self.micro_rounds), self.device_batch, 0
      sums = init
      if runs.get(k):
        n = runs.pop(k)
        chunks = jax.tree.map(lambda x: x[:n * k].reshape((n, k) + x.shape[1:]), batch)
        sums, _ = jax.lax.scan(rounds_of, sums, (chunks, jnp.arange(n) * k))
        start = n * k
      for j in sorted(runs, reverse=True):
        for _ in range(runs[j]):
          part = jax.tree.map(lambda x: x[start:start + j], batch)
          sums, _ = rounds_of(sums, (part, start))
          start += j
      return jax.lax.psum(sums, DEV)

    sums_of = jax.shard_map(per_device, mesh=meshes.local,
                            in_specs=(P(), P(), P(), P(DEV), P(), P(), P()), out_specs=P())

    def step(params, state, model_state, batch, key, round_index, first_block):
      opt_state, loss_scale = state
      sums = sums_of(params, model_state, loss_scale.scale, batch, key, round_index, first_block)
      norm = jnp.where(sums["weight"] != 0, sums["weight"], 1.0)
      grads = jax.tree.map(lambda g, p: (g / norm).astype(p.dtype), sums["grads"], params)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      count = sums["count"]
      new_model_state = jax.tree.map(
          lambda old, s: jnp.where(count > 0, s / jnp.maximum(count, 1.0), old).astype(old.dtype),
          model_state, sums["model_state"])
      stats = {"weight": sums["weight"], "count": count, "loss": sums["loss"],
               "metrics": sums["metrics"]}
      overflow = jnp.bool_(False)
      if scaled:  # This host's gradients overflowed: skip its local step, halve its scale.
        overflow = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                       for g in jax.tree.leaves(sums["grads"])]))
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(overflow, b, a), new, old)
        new_params, new_opt_state, new_model_state = keep(
            (new_params, new_opt_state, new_model_state), (params, opt_state, model_state))
        stats["skipped"] = overflow.astype(jnp.float32)
      loss_scale = precision_lib.next_scale(loss_scale, overflow, precision)
      return new_params, (new_opt_state, loss_scale), new_model_state, stats

    self._step = jax.jit(step, out_shardings=meshes.local_replicated, donate_argnums=(0, 1))

  def init_opt_state(self, params: PyTree) -> PyTree:
    """`(inner optimizer state, loss scale)`: what a host keeps besides its parameters."""
    return self._init_opt(params)

  def layout(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`b` rows -> `[devices, micro_rounds, m, ...]` with a mask, padding copies of row 0."""
    d, r, m = self.meshes.local_devices, self.micro_rounds, self.m
    n = len(next(iter(batch.values())))
    total = d * r * m
    out = {k: np.concatenate([v, np.repeat(v[:1], total - n, axis=0)]) for k, v in batch.items()}
    out[MASK] = (np.arange(total) < n).astype(np.float32)
    # Row order of a block is stream order; block g = r * d + j sits on device j.
    return {k: v.reshape((r, d, m) + v.shape[1:]).swapaxes(0, 1) for k, v in out.items()}

  def __call__(self, params: PyTree, opt_state: PyTree, model_state: PyTree,
               batch: dict[str, np.ndarray], key: jax.Array, round_index: int,
               first_block: int) -> tuple[PyTree, PyTree, PyTree, dict[str, jax.Array]]:
    if self._key is None or self._key[0] is not key:
      self._key = (key, jax.device_put(key, self.meshes.local_replicated))
    laid = jax.device_put(self.layout(batch), self.meshes.local_by_device)
    if self._step is None:
      block = jax.tree.map(lambda x: x[0, 0], laid)
      _, metrics, _ = jax.eval_shape(self.task.loss, params, model_state, block, self._key[1])
      self._build(sorted(metrics))
    return self._step(params, opt_state, model_state, laid, self._key[1],
                      np.int32(round_index), np.int32(first_block))


@jax.jit
def _distance(mine: PyTree, my_weight: jax.Array, totals: PyTree, total_weight: jax.Array
              ) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(m / my_weight - t / total_weight))
                      for m, t in zip(jax.tree.leaves(mine), jax.tree.leaves(totals))))


def spread(mine: PyTree, my_weight: float, totals: PyTree, total_weight: float,
           meshes: Meshes) -> jax.Array:
  """`||x_i - mean||` from what the round's reduction already holds, on this host's devices.

  Both modes reduce a tree of the form `sum_j w_j (x_j - c)` (up to sign)
  whose weights make `totals / total_weight` the hosts' sample-weighted
  mean minus `c`, while `mine / my_weight` is `x_i - c`: the difference is
  this host's distance to the mean, and no second full-size sum is needed.
  """
  local = jax.tree.map(lambda x: mesh_lib.to_local(x, meshes), totals)
  return _distance(mine, jnp.float32(my_weight), local, jnp.float32(total_weight))


def to_host_mesh(tree: PyTree, meshes: Meshes) -> PyTree:
  """A copy of global replicated arrays on this host's devices (local mesh)."""
  return jax.tree.map(lambda x: jnp.copy(mesh_lib.to_local(x, meshes)), tree)


# ---- 4. The one cross-host reduction of a round ------------------------------


class RoundReduction:
  """Sums one per-host tree over the hosts and gathers a small vector from each.

  'device': one global program over every device (NCCL on GPU, gloo here);
  each host's tree sits on its first device row, zeros on the others.
  'host': the trees go to host memory and are summed with CPU collectives,
  as `hetjax.step.HostReduction` does, for hosts whose accelerators cannot
  share one collective. Either way the result is global replicated arrays.
  """

  def __init__(self, backend: str, meshes: Meshes):
    if backend not in ("device", "host"):
      raise ValueError(f"unknown reduction backend {backend!r}; choose 'device' or 'host'.")
    self.backend, self.meshes = backend, meshes
    d = meshes.local_devices
    self._spread = jax.jit(
        lambda t: jax.tree.map(lambda x: jnp.zeros((d,) + x.shape, x.dtype).at[0].set(x), t),
        out_shardings=meshes.local_by_device)
    self._sum_world = jax.jit(
        lambda t, rows: (jax.tree.map(lambda x: jnp.sum(x, axis=0), t), rows),
        out_shardings=meshes.replicated)
    if backend == "host":
      check_values_over_hosts(meshes, "the host reduction")
      mesh = meshes.hosts
      self._by_host = NamedSharding(mesh, P(mesh_lib.HOSTS))
      self._sum_hosts = jax.jit(lambda t: jax.tree.map(lambda a: jnp.sum(a, axis=0), t),
                                out_shardings=NamedSharding(mesh, P()))
      # gloo's first collective on a new device set gives up after 30 s; line
      # the hosts up first (see hetjax.step.HostReduction).
      probe = jax.make_array_from_process_local_data(self._by_host, np.zeros((1, 1), np.float32))
      compiled = self._sum_hosts.lower(probe).compile()
      mesh_lib.gather_host_values(np.zeros(1), meshes)
      compiled(probe).block_until_ready()

  def __call__(self, tree: PyTree, host_values: np.ndarray) -> tuple[PyTree, np.ndarray]:
    """`(sum over hosts of tree, as global replicated arrays; [hosts, k] values)`."""
    meshes = self.meshes
    if self.backend == "device":
      world = jax.tree.map(lambda x: mesh_lib.to_world(x, meshes), self._spread(tree))
      totals, rows = self._sum_world(world, mesh_lib.host_rows(host_values, meshes))
      return totals, mesh_lib.rows_by_host(np.asarray(rows), meshes)
    mine = jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[None], tree)
    mine["hetjax.host_values"] = np.asarray(host_values, np.float32).reshape(1, 1, -1)
    to_cpu = lambda x: jax.make_array_from_process_local_data(self._by_host, x)
    # The host values ride in the same collective: row h holds host h's
    # vector (a sum of one non-zero row per position).
    h, k = meshes.num_hosts, mine["hetjax.host_values"].shape[-1]
    placed = np.zeros((1, h, k), np.float32)
    placed[0, meshes.host_id] = mine.pop("hetjax.host_values")[0, 0]
    mine["hetjax.host_values"] = placed
    totals = jax.device_get(self._sum_hosts(jax.tree.map(to_cpu, mine)))
    rows = np.asarray(totals.pop("hetjax.host_values"))
    replicated = meshes.replicated
    totals = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x), totals)
    return totals, rows

