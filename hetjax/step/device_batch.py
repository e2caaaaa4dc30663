"""`--device-batch auto`: each host's device batch from its device's memory and speed.

The largest power of two `k` (its ladder `k, k/2, ..., 1` then makes every remainder from one
program of each size) whose one-block program's `memory_analysis()` estimate fits in `fraction`
of the device's `bytes_limit` (XLA:CPU reports none: `CPU_DEFAULT`), capped by `cap` and
`MAX_K`; then `k` runs against `k/2` and the faster per block stays (a program that no longer
fills the device better only pads the ladder). Blocks stay separate blocks, so the choice
changes the speed, never the math: hosts may choose differently and a resumed run anew. The
balancer prices each host's ladder, so the choices travel in one small collective (`agree`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.mesh import Meshes, gather_host_values
from hetjax.step.block import blocks_sums
from hetjax.task import MASK, Task

# Where a device reports no memory (XLA:CPU): bench/device_batch.py measured
# device batches of 8 blocks well ahead of single blocks there (cnn and
# resnet18 at --microbatch 4, 2 devices); a larger k needs more blocks per
# device per step before it runs a full program.
CPU_DEFAULT = 8
MAX_K = 64      # A ladder of 7 programs; more compile time than any device gains.
REPEATS = 3     # Timed runs of each candidate (after one warm-up run each).


class Choice(NamedTuple):
  """One host's device batch and why."""

  k: int
  memory_k: int | None          # the largest k the memory estimate allows; None: not reported
  seconds_per_block: dict[int, float]  # measured, per candidate k

  def describe(self) -> str:
    memory = ("no memory reported, default " + str(min(CPU_DEFAULT, MAX_K))
              if self.memory_k is None else f"memory fits {self.memory_k}")
    timed = ", ".join(f"{j} blocks {s * 1e3:.3g} ms/block"
                      for j, s in sorted(self.seconds_per_block.items(), reverse=True))
    return f"device batch {self.k} ({memory}" + (f"; {timed}" if timed else "") + ")"


def power_of_two_at_most(n: float) -> int:
  """The largest power of two <= `n` (1 when `n < 2`)."""
  return 1 << max(0, int(np.floor(np.log2(max(float(n), 1.0)))))


def memory_k(stats: dict[str, Any] | None, memory: Any, block_bytes: int, fraction: float,
             cap: int) -> int | None:
  """The largest power of two `k <= cap` whose estimate fits in `fraction` of the limit (None:
  no limit reported). Estimate: bytes in use + the one-block program's outputs + `k` times
  (its temporaries + a block's input); an upper bound (some temporaries do not grow with `k`)."""
  if not stats or not stats.get("bytes_limit"):
    return None
  per_block = int(getattr(memory, "temp_size_in_bytes", 0)) + int(block_bytes)
  fixed = int(stats.get("bytes_in_use", 0)) + int(getattr(memory, "output_size_in_bytes", 0))
  room = fraction * float(stats["bytes_limit"]) - fixed
  k = room / per_block if per_block > 0 else cap
  return min(power_of_two_at_most(k), power_of_two_at_most(cap))


def choose(task: Task, params: Any, model_state: Any, example: dict[str, np.ndarray],
           microbatch: int, *, device: jax.Device, precision: str = "fp32",
           blocks_full: bool = False, fraction: float = 0.8, cap: int = MAX_K,
           repeats: int = REPEATS, clock: Callable[[], float] = time.perf_counter) -> Choice:
  """This host's device batch (module docstring). `params`, `model_state`: copied to `device`;
  `example`: one record, repeated into blocks; `cap`: most blocks a device gets in one step."""
  cap = max(1, min(int(cap), MAX_K))
  params, model_state = jax.device_put((params, model_state), device)
  block = {k: np.repeat(np.asarray(v)[:1], microbatch, axis=0) for k, v in example.items()}
  block[MASK] = np.ones(microbatch, np.float32)
  block_bytes = sum(v.nbytes for v in block.values())
  scale = jnp.ones((), jnp.float32)

  def sums(params, model_state, blocks, keys):
    return blocks_sums(task, params, model_state, blocks, keys, scale, precision, blocks_full)

  program = jax.jit(sums)

  def inputs(j: int):
    blocks = jax.device_put({k: np.broadcast_to(v, (j,) + v.shape) for k, v in block.items()},
                            device)
    keys = jax.device_put(jax.random.split(jax.random.key(0), j), device)
    return params, model_state, blocks, keys

  stats = device.memory_stats()
  fits = None
  if stats and stats.get("bytes_limit"):
    memory = program.lower(*inputs(1)).compile().memory_analysis()
    fits = memory_k(stats, memory, block_bytes, fraction, cap)
  k = fits if fits is not None else min(power_of_two_at_most(CPU_DEFAULT),
                                        power_of_two_at_most(cap))
  if k == 1:
    return Choice(1, fits, {})
  candidates = (k, k // 2)
  compiled = {j: program.lower(*inputs(j)).compile() for j in candidates}
  args = {j: inputs(j) for j in candidates}
  seconds = {j: [] for j in candidates}
  for j in candidates:  # Warm-up: first runs pay for allocation.
    jax.block_until_ready(compiled[j](*args[j]))
  for _ in range(max(1, repeats)):
    for j in candidates:
      start = clock()
      jax.block_until_ready(compiled[j](*args[j]))
      seconds[j].append((clock() - start) / j)
  per_block = {j: float(np.median(v)) for j, v in seconds.items()}
  best = k if per_block[k] <= per_block[k // 2] else k // 2
  return Choice(best, fits, per_block)


def agree(k: int, meshes: Meshes) -> tuple[int, ...]:
  """Every host's device batch, from one small collective (the same on every host)."""
  if meshes.num_hosts == 1:
    return (int(k),)
  rows = gather_host_values(np.array([float(k)], np.float32), meshes)
  return tuple(int(round(float(v))) for v in rows[:, 0])


def for_hosts(config: Any, task: Task, params: Any, model_state: Any,
              example: dict[str, np.ndarray], meshes: Meshes, samples: int | None = None
              ) -> tuple[int, ...]:
  """Every host's device batch for a run: `config.device_batch` (a `TrainConfig`) as
  given, or under 'auto' each host's `choose` (printed), gathered (`agree`).

  `samples`: the most a host computes in one step (default: the global batch), capping `k`.
  """
  fixed = config.device_batches(meshes.num_hosts)
  if fixed is not None:
    return fixed
  mine = jax.tree.map(lambda x: x.addressable_data(0), (params, model_state))
  blocks = -(-int(samples or config.global_batch) // int(config.microbatch))
  choice = choose(task, *mine, example, int(config.microbatch),
                  device=meshes.local.devices.flat[0], precision=config.precision,
                  blocks_full=int(config.global_batch) % int(config.microbatch) == 0,
                  fraction=config.device_batch_memory_fraction,
                  cap=-(-blocks // meshes.local_devices))
  print(f"hetjax: host {meshes.host_id}: {choice.describe()}", flush=True)
  return agree(choice.k, meshes)
