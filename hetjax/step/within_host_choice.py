"""`--shard-within-host auto`: each host splits its parameters over its devices when its memory asks.

The one-block program's `memory_analysis()` plus what a device keeps between programs
(parameters, packed pending replica, float32 sums row) against `bytes_limit` or the given
`device_memory` (XLA:CPU reports none: emulated, and said so). Sharding goes on only when the
whole state does not fit (its gathers cost time). Each host decides alone; nothing that crosses
hosts depends on it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.mesh import Meshes
from hetjax.step import within_host as within_lib
from hetjax.step.block import blocks_sums
from hetjax.step.sharding import tree_bytes
from hetjax.task import MASK, Task

PyTree = Any


def estimate(task: Task, params: PyTree, model_state: PyTree, example: dict[str, np.ndarray],
             microbatch: int, devices: int, device: jax.Device, precision: str = "fp32",
             blocks_full: bool = False) -> tuple[int | None, int | None]:
  """A device's bytes (without, with) sharding over `devices`; None where XLA gives none.

  Without: parameters, pending packed replica, float32 sums row and the one-block program's
  temporaries. With: parameters as slabs, the same replica and row, temporaries less the whole
  gradient tree. An estimate: `LocalProgram.peak_bytes` is the measure (`bench/memory.py`).
  """
  params, model_state = jax.device_put((params, model_state), device)
  block = {k: np.repeat(np.asarray(v)[:1], microbatch, axis=0)[None] for k, v in example.items()}
  block[MASK] = np.ones((1, microbatch), np.float32)
  keys = jax.random.split(jax.random.key(0), 1)
  scale = jnp.ones((), jnp.float32)
  program = jax.jit(lambda p, s, b, k: blocks_sums(task, p, s, b, k, scale, precision,
                                                   blocks_full))
  peak = within_lib.peak_bytes(program.lower(params, model_state, block, keys).compile())
  if peak is None:
    return None, None
  p_bytes, state_bytes = tree_bytes(params), tree_bytes(model_state)
  row = 4 * sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))
  split = within_lib.Split(params, devices).bytes_per_device()["rows"]
  activations = max(0, peak - p_bytes - state_bytes - row)  # peak holds params and grads
  whole = p_bytes + (p_bytes + state_bytes) + row + activations + row
  rows = split + (p_bytes + state_bytes) + row + activations
  return int(whole), int(rows)


def for_host(config: Any, task: Task, params: PyTree, model_state: PyTree,
             example: dict[str, np.ndarray], meshes: Meshes) -> within_lib.Decision:
  """This host's choice under `config.shard_within_host` (printed when 'auto' decides).

  `params` and `model_state` are global replicated arrays (this host reads its own copy).
  """
  mode = within_lib.mode_of(config.shard_within_host, meshes.host_id)
  devices = meshes.local_devices
  if mode != "auto" or devices < 2:
    return within_lib.decide(mode, devices, None, None, None, False, 1.0)
  device = meshes.local.devices.flat[0]
  limit, emulated = _limit(config, device)
  need = (None, None)
  if limit is not None:
    mine = jax.tree.map(lambda x: x.addressable_data(0), (params, model_state))
    need = estimate(task, *mine, example, int(config.microbatch), devices, device,
                    config.precision, int(config.global_batch) % int(config.microbatch) == 0)
  decision = within_lib.decide(mode, devices, *need, limit, emulated,
                               config.device_batch_memory_fraction)
  print(f"hetjax: host {meshes.host_id}: {decision.describe()}", flush=True)
  return decision


def _limit(config: Any, device: jax.Device) -> tuple[int | None, bool]:
  """The device's memory: `config.device_memory` (GB, emulated) or what it reports."""
  if getattr(config, "device_memory", None):
    return int(float(config.device_memory) * 1e9), True
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  return (int(limit), False) if limit else (None, False)
