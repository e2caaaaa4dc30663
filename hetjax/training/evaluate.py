"""Evaluation over a whole split, spread over every host and device, streamed.

Compiled once (the parameters are arguments: no recompile every N steps);
streamed `batch` records at a time; host `h` takes a contiguous slice sized by
its weight (its share of the global batch), and one small collective sums the
results: the exact mean over the split, whatever the split of work.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from hetjax import mesh as mesh_lib
from hetjax import step as step_lib
from hetjax.cluster import watchdog
from hetjax.task import MASK, Task, split_losses

PyTree = Any
COUNT = "count"


def host_ranges(num_records: int, weights: Sequence[float]) -> list[tuple[int, int]]:
  """Contiguous `[start, stop)` slices of `num_records`, sized by `weights` (all zero: equal)."""
  w = np.asarray(weights, np.float64)
  if w.size == 0 or np.any(w < 0):
    raise ValueError(f"evaluation weights must be >= 0, one per host; got {list(weights)}.")
  if w.sum() <= 0:
    w = np.ones_like(w)
  bounds = np.floor(np.cumsum(w) / w.sum() * num_records).astype(np.int64)
  bounds[-1] = num_records
  starts = np.concatenate([[0], bounds[:-1]])
  return [(int(a), int(b)) for a, b in zip(starts, bounds)]


class Evaluator:
  """Sums of `task.evaluation_loss()`'s losses and metrics over this host's slice of a split,
  `batch_per_device` records per device per call (the compiled shape)."""

  def __init__(self, task: Task, meshes: mesh_lib.Meshes, batch_per_device: int):
    if batch_per_device < 1:
      raise ValueError(f"evaluation batch per device must be >= 1, got {batch_per_device}.")
    self.meshes = meshes
    self.batch = batch_per_device * meshes.local_devices
    self._loss_fn = loss_fn = task.evaluation_loss()

    def per_device(params, model_state, batch):
      losses, metrics, _ = loss_fn(params, model_state, batch, jax.random.key(0))
      values, weights = split_losses(losses)
      real = batch[MASK] > 0
      total = lambda v: jnp.sum(jnp.where(real, v, 0.0))
      # The normaliser is the training one: real examples, or their weights.
      count = total(weights) if weights is not None else jnp.sum(real.astype(jnp.float32))
      sums = {"loss": total(values), COUNT: count}
      sums.update({k: total(v) for k, v in metrics.items()})
      return {k: v[None] for k, v in sums.items()}

    self._sums = jax.jit(jax.shard_map(
        per_device, mesh=meshes.local, in_specs=(P(), P(), P(mesh_lib.DEV)),
        out_specs=P(mesh_lib.DEV)))
    self._names: list[str] | None = None

  def _metric_names(self, params, model_state, example) -> list[str]:
    if self._names is None:
      _, metrics, _ = jax.eval_shape(self._loss_fn, params, model_state, example,
                                     jax.random.key(0))
      self._names = ["loss", *sorted(metrics), COUNT]
    return self._names

  def local_sums(self, params: PyTree, model_state: PyTree, source: Any,
                 start: int, stop: int) -> np.ndarray:
    """Sums over records `[start, stop)` of `source`, in `names` order, as float64
    (`params`, `model_state`: global replicated arrays)."""
    local = lambda tree: jax.tree.map(lambda x: mesh_lib.to_local(x, self.meshes), tree)
    params, model_state = local(params), local(model_state)
    example = {**source[np.arange(1)], MASK: np.ones(1, np.float32)}
    names = self._metric_names(params, model_state, example)
    total = np.zeros(len(names), np.float64)
    sharding = self.meshes.local_by_device
    pending = None
    for first in range(start, stop, self.batch):
      # A full batch with its `MASK`; padding repeats a real row (finite losses).
      records = next(step_lib.micro_batches(
          source[np.arange(first, min(first + self.batch, stop))], self.batch))
      out = self._sums(params, model_state, jax.device_put(records, sharding))
      watchdog.WATCHDOG.tick()  # A long split that moves is no stall.
      if pending is not None:  # Fetch one batch late, so the next one is already queued.
        total += _ordered(jax.device_get(pending), names)
      pending = out
    if pending is not None:
      total += _ordered(jax.device_get(pending), names)
    return total

  def evaluate(self, params: PyTree, model_state: PyTree, source: Any,
               weights: Sequence[float]) -> dict[str, float]:
    """The mean loss and metrics over all of `source` (every host must call it)."""
    ranges = host_ranges(len(source), weights)
    if len(ranges) != self.meshes.num_hosts:
      raise ValueError(f"evaluation weights need one entry per host ({self.meshes.num_hosts}), "
                       f"got {len(ranges)}.")
    start, stop = ranges[self.meshes.host_id]
    mine = self.local_sums(params, model_state, source, start, stop)
    # float32 rows hold counts exactly up to 2^24 records per host.
    rows = mesh_lib.gather_host_values(mine, self.meshes).astype(np.float64)
    totals = dict(zip(self._names, rows.sum(axis=0)))
    count = totals.pop(COUNT)
    if count <= 0:
      raise ValueError("the evaluation split has no records.")
    return {k: float(v / count) for k, v in totals.items()}


def _ordered(sums: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
  return np.array([float(np.sum(sums[k])) for k in names], np.float64)
