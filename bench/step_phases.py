"""Where hetjax's extra time per step goes: each compiled program timed alone.

Run from the repository root (a minute or two):

  python bench/step_phases.py [--models cnn,resnet18,resnet50] [--repeats 15]

`bench/overhead.py` compares whole loops; this script explains its result.
For each model (the same settings as `bench/overhead.py`, 1 host x 1
device, one micro-batch per step) it times, interleaved and each waited on
alone (medians):

  plain      the hand-written loop's one program: loss, gradient, adam;
  local      hetjax's local program without an update (a step's later
             micro-batches, or its first after a checkpoint): loss,
             gradient, sums packed in a row;
  fused      the local program of a step's first micro-batch: the last
             step's update, then `local`;
  reduce     hetjax's reduction program: the rows summed, the statistics;
  update     the update alone (`LocalProgram.update`: a host with no
             micro-batch, a checkpoint, the end of `fit`): the row
             unpacked, adam, the model state;
  adam       adam alone on the unpacked gradients (part of `update`);
  masked     the local program with the padding mask, as it ran before whole
             blocks dropped it (`Task.unmasked_loss`); models whose task has
             no unmasked loss run the same program either way ("-");
  split      the hand-written step as two programs, gradient then update
             (`overhead.PlainLoop(programs=2)`), no hetjax code: what the
             boundary a cross-host reduction needs costs by itself.

`fused + reduce - plain` is the time hetjax's device work adds to a step
(`added`), `split - plain` what a second program costs whatever it holds
(`boundary`; hetjax's second program is the small reduction); the rest of
`bench/overhead.py`'s figure is host work (Python, transfers).
On a CPU the "device" is the same cores as the host, so the plain loop's
single fused program has an edge that two programs cannot recover there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax.input import data as data_lib
from hetjax import step as step_lib
from hetjax import models as zoo
import overhead


def _median_ms(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Each callable's median wall time in ms, run interleaved and waited on."""
  times: dict[str, list[float]] = {name: [] for name in runs}
  for fn in runs.values():  # Compile and warm up.
    jax.block_until_ready(fn())
  for _ in range(repeats):
    for name, fn in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append((time.perf_counter() - t0) * 1e3)
  return {name: round(statistics.median(v), 3) for name, v in times.items()}


def measure(name: str, source: data_lib.ArraySource, repeats: int) -> dict[str, float]:
  """The programs of one model, timed alone."""
  setting = overhead.SETTINGS[name]
  task = zoo.build(name, kind=source.info.kind, num_classes=source.info.num_classes,
                             **setting.overrides)
  optimizer = optax.adam(overhead.LEARNING_RATE)
  plain = overhead.PlainLoop(task, optimizer, source, setting.global_batch, "fp32")
  split = overhead.PlainLoop(task, optimizer, source, setting.global_batch, "fp32", programs=2)
  config = hetjax.TrainConfig(global_batch=setting.global_batch,
                              microbatch=setting.global_batch, seed=overhead.SEED)
  trainer = hetjax.Trainer(task, optimizer, source, config)
  masked = None
  if task.unmasked_loss is not None:
    masked = hetjax.Trainer(dataclasses.replace(task, unmasked_loss=None), optimizer, source,
                            config)
  for _ in range(2):
    plain.train_step()
    split.train_step()
    trainer.train_step()
    if masked is not None:
      masked.train_step()
  plain.wait()
  split.wait()
  local, meshes = trainer.local, trainer.meshes
  layout = local.layout
  host = np.zeros(4, np.float32)  # Stands in for the trainer's host vector.
  micro, real = next(step_lib.padded_chunks(
      trainer.loader.get(trainer.step, (setting.global_batch,)), local.micro))
  micro[step_lib._POSITION] = step_lib._position_rows(trainer.step, 0, True, real, local.per_device,
                                                      1, host)
  micro = jax.device_put(micro, meshes.local_by_device)
  key = jax.device_put(jax.random.key(overhead.SEED), meshes.local_replicated)
  plain_batch, rng = jax.device_put(plain.batch(0)), jax.random.key(0)
  state = trainer.local_state
  box = {"sums": local._zeros(state.loss_scale.scale, host),
         "plain": (plain.params, plain.opt_state, plain.model_state),
         # Each program's own copy of the state: the fused and update programs donate theirs.
         "fused": jax.tree.map(jnp.copy, state), "alone": jax.tree.map(jnp.copy, state)}
  reduction = trainer.reduction
  # A copy: in this one-device world the total is the sums row, which run_local donates.
  total = jnp.copy(reduction(step_lib.LocalSums(box["sums"], layout)).total)
  adam = jax.jit(lambda st, total: optimizer.update(
      layout.sums.unpack({"float32": step_lib.summed_row(total, layout)}).grads, st.opt_state,
      st.params))

  def run_plain():
    out = plain._step(*box["plain"], plain_batch, rng)
    box["plain"] = out[:3]
    return out

  def run_split():
    out = split._step(split.params, split.opt_state, split.model_state, plain_batch, rng)
    split.params, split.opt_state, split.model_state = out[:3]
    return out

  def run_local():
    box["sums"] = local._grad(state, box["sums"], micro, key)
    return box["sums"]

  def run_fused():
    box["fused"], lr, row = local._update_then_grad(box["fused"], total, micro, key)
    return row

  def run_update():
    box["alone"], lr = local.update(box["alone"], total)
    return box["alone"]

  runs = {"plain": run_plain, "local": run_local, "fused": run_fused}
  if masked is not None:
    masked_state = masked.local_state
    box["masked"] = masked.local._zeros(masked_state.loss_scale.scale, host)

    def run_masked():
      box["masked"] = masked.local._grad(masked_state, box["masked"], micro, key)
      return box["masked"]

    runs["masked"] = run_masked
  result = _median_ms({
      **runs, "reduce": lambda: reduction(step_lib.LocalSums(box["sums"], layout)).report,
      "update": run_update, "adam": lambda: adam(state, total), "split": run_split}, repeats)
  result.setdefault("masked", None)
  result["added"] = round(result["fused"] + result["reduce"] - result["plain"], 3)
  result["boundary"] = round(result["split"] - result["plain"], 3)
  result["row_floats"] = layout.row_size
  trainer.close()
  if masked is not None:
    masked.close()
  return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--models", default="cnn,resnet18,resnet50")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args(argv)
  models = overhead.model_names(parser, args.models)
  hetjax.initialize()
  source = data_lib.load("digits")
  print(f"hetjax step phases (ms, each program alone, median of {args.repeats}); "
        f"{jax.devices()[0].platform}, jax {jax.__version__}")
  print(f"{'model':>9} {'plain':>8} {'local':>8} {'fused':>8} {'masked':>8} {'reduce':>8} "
        f"{'update':>8} {'adam':>8} {'added':>8} {'split':>8} {'boundary':>8}")
  rows = {}
  for name in models:
    r = rows[name] = measure(name, source, args.repeats)
    masked_ms = "-" if r["masked"] is None else f"{r['masked']:.2f}"
    print(f"{name:>9} {r['plain']:>8.2f} {r['local']:>8.2f} {r['fused']:>8.2f} {masked_ms:>8} "
          f"{r['reduce']:>8.2f} {r['update']:>8.2f} {r['adam']:>8.2f} {r['added']:>8.2f} "
          f"{r['split']:>8.2f} {r['boundary']:>8.2f}", flush=True)
  print(json.dumps(rows))
  return rows


if __name__ == "__main__":
  main()
