"""hetjax's step against the bare bound of its design: what its bookkeeping costs.

Run from the repository root (a minute or two a model):

  python bench/fused_update.py [--models resnet18,resnet50] [--repeats 31]

This script first bounded what moving the update into the next step's local
program would save (the design hetjax now runs: `hetjax.step.LocalProgram`).
It times, on 1 host x 1 device, interleaved in one run (medians of the
per-repeat step times, and of the paired differences against plain):

  plain   the hand-written one-program loop (`overhead.PlainLoop`);
  split   the same cut into gradient and update programs;
  hetjax  hetjax's local programs and reduction driven by a bare loop, as
          `Trainer.fit` drives them (statistics fetched one step late), with
          no other `Trainer` bookkeeping;
  fused   the bare sketch of the same design: a tiny reduction program (the
          row summed), then ONE program that applies the previous step's
          update from that row and runs this step's forward and backward,
          with nothing fetched, no host vector and no shard_map.

`fused` stays a bound: it skips what the real step must do (the host
vector and statistics every step, a host with no micro-batch, the state
read for checkpoints and evaluation).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax.input import data as data_lib
from hetjax import step as step_lib
from hetjax.task import MASK
from hetjax import models as zoo
import overhead


class HetjaxPrograms:
  """hetjax's two programs per step, fed like `Trainer.fit` feeds them, nothing else."""

  def __init__(self, trainer: hetjax.Trainer, sampler: data_lib.GlobalSampler,
               source: data_lib.ArraySource):
    self.trainer, self.sampler, self.source = trainer, sampler, source
    self.step, self.pending = 0, None
    self.state = trainer.local_state
    self.host_values = np.zeros(4, np.float32)

  def run(self, steps: int) -> None:
    t = self.trainer
    for _ in range(steps):
      batch = self.source[self.sampler.indices(self.step)]
      update = None if self.pending is None else self.pending.total
      local = t.local(self.state, update, batch, t._example, t._base_key, self.step, 0,
                      self.host_values)
      self.state, reduced = local.state, t.reduction(local.sums)
      if self.pending is not None:
        self.pending.fetch()
      self.pending, self.step = reduced, self.step + 1

  def wait(self) -> None:
    # The last update waits for the next run's first program, as after `fit`.
    jax.block_until_ready((self.state, self.pending.total if self.pending else None))


class FusedSketch:
  """The previous step's update and this step's gradient in one program."""

  def __init__(self, task, optimizer, source, sampler, layout: step_lib.Layout, batch: int):
    self.source, self.sampler, self.batch = source, sampler, batch
    self.mask = np.ones(batch, np.float32)
    example = {**source[sampler.indices(0)], MASK: self.mask}
    params, model_state = jax.jit(task.init)(jax.random.key(overhead.SEED), example)
    weight_at = sum(x.size for x in jax.tree.leaves(params))  # The row: gradients, then weight.
    first = jnp.zeros(layout.row_size, jnp.float32).at[weight_at].set(1.0)  # weight 1, count 0
    self.state = [params, jax.jit(optimizer.init)(params), model_state, first[None]]
    self.key, self.step = jax.random.key(overhead.SEED), 0

    def program(params, opt_state, model_state, total, block, rng):
      t = layout.sums.unpack({"float32": total})
      norm = jnp.where(t.weight != 0, t.weight, 1.0)
      grads = jax.tree.map(lambda g: g / norm, t.grads)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      safe = jnp.maximum(t.count, 1.0)
      model_state = jax.tree.map(lambda old, s: jnp.where(t.count > 0, s / safe, old),
                                 model_state, t.model_state)
      sums = step_lib.block_sums(task, params, model_state, block, rng, jnp.float32(1.0), "fp32",
                                 blocks_full=True)
      return params, opt_state, model_state, layout.sums.pack(sums)["float32"]

    self._program = jax.jit(program, donate_argnums=(0, 1, 2))
    self._reduce = jax.jit(lambda rows: jnp.sum(rows, axis=0))

  def run(self, steps: int) -> None:
    for _ in range(steps):
      block = jax.device_put({**self.source[self.sampler.indices(self.step)], MASK: self.mask})
      params, opt_state, model_state, rows = self.state
      total = self._reduce(rows)
      params, opt_state, model_state, row = self._program(
          params, opt_state, model_state, total, block, jax.random.fold_in(self.key, self.step))
      self.state, self.step = [params, opt_state, model_state, row[None]], self.step + 1

  def wait(self) -> None:
    jax.block_until_ready(self.state)


def measure(name: str, source: data_lib.ArraySource, repeats: int) -> dict[str, Any]:
  """The four loops of one model, interleaved; ms per step and paired ms against plain."""
  setting = overhead.SETTINGS[name]
  batch = setting.global_batch
  task = zoo.build(name, kind=source.info.kind, num_classes=source.info.num_classes,
                             **setting.overrides)
  optimizer = optax.adam(overhead.LEARNING_RATE)
  trainer = hetjax.Trainer(task, optimizer, source, hetjax.TrainConfig(
      global_batch=batch, microbatch=batch, seed=overhead.SEED))
  trainer.fit(2)  # Builds the programs and the layout.
  sampler = data_lib.GlobalSampler(len(source), batch, overhead.SEED)
  loops = {
      "plain": overhead.PlainLoop(task, optimizer, source, batch, "fp32"),
      "split": overhead.PlainLoop(task, optimizer, source, batch, "fp32", programs=2),
      "hetjax": HetjaxPrograms(trainer, sampler, source),
      "fused": FusedSketch(task, optimizer, source, sampler, trainer.local.layout, batch),
  }
  for loop in loops.values():
    overhead.seconds(loop, overhead.WARMUP_STEPS)
  ms: dict[str, list[float]] = {label: [] for label in loops}
  for _ in range(repeats):
    for label, loop in loops.items():
      ms[label].append(overhead.seconds(loop, setting.steps) / setting.steps * 1e3)
  trainer.close()
  return {label: {"ms": round(statistics.median(v), 3),
                  "vs_plain_ms": round(statistics.median(b - a for a, b in zip(ms["plain"], v)), 3)}
          for label, v in ms.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--models", default="resnet18,resnet50")
  parser.add_argument("--repeats", type=int, default=31)
  args = parser.parse_args(argv)
  models = overhead.model_names(parser, args.models)
  hetjax.initialize()
  source = data_lib.load("digits")
  print(f"fused-update bound (ms per step; paired vs plain), {args.repeats} repeats; "
        f"{jax.devices()[0].platform}, jax {jax.__version__}")
  rows = {}
  for name in models:
    r = rows[name] = measure(name, source, args.repeats)
    print(f"{name:>9} " + "  ".join(f"{label} {v['ms']:.2f} ({v['vs_plain_ms']:+.2f})"
                                     for label, v in r.items()), flush=True)
  print(json.dumps(rows))
  return rows


if __name__ == "__main__":
  main()
