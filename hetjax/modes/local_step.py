"""A round's local step: `b` samples in blocks on this host's devices, then the inner update.

No cross-host collective, so hosts run different numbers of them; the inner
update is the sync step's rule (`hetjax.step.optimizer_step`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax import blocks as blocks_lib
from hetjax import step as step_lib
from hetjax.balancer.ladder import Ladder
from hetjax.mesh import DEV, Meshes
from hetjax.step import precision as precision_lib
from hetjax.task import MASK, Task

PyTree = Any


class LocalStep:
  """One local step: `b` samples in blocks on this host's devices, then the inner update.

  One compiled program per step: each device scans over its blocks
  (device j of micro-round r runs block `first + r * d + j`), the sums meet
  in a psum over this host's devices only, and the inner optax update
  follows. A device batch `k` runs `k` micro-rounds' blocks at once (each block still its
  own), the rest through the ladder's smaller sizes: the same blocks, keys and sums.

  Under fp16 each host keeps its own loss scale: a local step that overflows is skipped on
  that host alone (the reduction sums models, not gradients, so no other host needs to know).
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
    self.optimizer, self.task = optimizer, task
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

    # The update rule reads only the precision of a layout: a local step has no packed row.
    layout = step_lib.Layout(sums=None, precision=precision)

    def step(params, state, model_state, batch, key, round_index, first_block):
      opt_state, loss_scale = state
      sums = sums_of(params, model_state, loss_scale.scale, batch, key, round_index, first_block)
      totals = step_lib.Sums(sums["grads"], sums["weight"], sums["count"], sums["loss"],
                             sums["metrics"], sums["model_state"])
      stats = {"weight": sums["weight"], "count": sums["count"], "loss": sums["loss"],
               "metrics": sums["metrics"]}
      overflow = jnp.bool_(False)
      if scaled:  # This host's gradients overflowed: its local step is skipped, its scale halved.
        overflow = ~jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                       for g in jax.tree.leaves(sums["grads"])]))
        stats["skipped"] = overflow.astype(jnp.float32)
      inner = step_lib.TrainState(jnp.zeros((), jnp.int32), params, opt_state, model_state,
                                  loss_scale)
      new, _ = step_lib.optimizer_step(optimizer, inner, totals, overflow, layout)
      return new.params, (new.opt_state, new.loss_scale), new.model_state, stats

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


