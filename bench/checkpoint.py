"""How long a checkpoint stalls training: asynchronous vs synchronous saves.

Run: `.venv/bin/python bench/checkpoint.py` (one host, CPU; a few minutes).

For the ResNet-18 and the transformer, one run trains with a checkpoint
every `--every` steps, with asynchronous saves (the default) and then with
synchronous ones, in the same invocation. The stall of a save is the extra
wall time of the step that saves and the step after it, over two median
steps without a save; it is printed as a fraction of a median step, next to
how long the save call itself blocks the loop (the hosts' parameter
fingerprint check; the step's own update, which otherwise runs in the next
step's first program and which a save needs applied first; then, for an
asynchronous save, dispatching a copy of the state: "snapshot") and how long
orbax's own synchronous part (the hand-over) takes, which an asynchronous save runs on a worker thread. On this 2-core
machine the worker's hand-over, the copy and orbax's background write
compete with the step for the same cores (the devices are these cores), so
the next step's extra wall time shows that contention; on a GPU server they
run on otherwise idle host cores. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from typing import Callable

import optax

import hetjax
from hetjax import models as zoo
from hetjax.input import data

MODELS = {
    "resnet18": ("synthetic", {}),
    "transformer": ("tokens", {}),
}


def _trainer(model: str, global_batch: int, directory: str, async_save: bool) -> hetjax.Trainer:
  dataset, overrides = MODELS[model]
  source = data.load(dataset)
  task = zoo.build(model, kind=source.info.kind, num_classes=source.info.num_classes,
                   vocab_size=source.info.vocab_size, **overrides)
  config = hetjax.TrainConfig(global_batch=global_batch, microbatch=global_batch)
  return hetjax.Trainer(task, optax.adam(1e-3), source, config,
                         checkpoint=saving_every_call(directory, async_save))


def saving_every_call(directory: str, async_save: bool) -> hetjax.CheckpointConfig:
  """A checkpoint folder that saves only when asked (the benchmark calls each save)."""
  return hetjax.CheckpointConfig(directory, every=10 ** 9, keep=2, resume=False,
                                     async_save=async_save)


def measure(build: Callable[[str, bool], hetjax.Trainer], async_save: bool, steps: int,
            every: int) -> dict:
  """Per-step wall times of a run that saves every `every` steps.

  `build(directory, async_save)` returns the trainer, checkpointing into
  `directory` with `saving_every_call`.
  """
  with tempfile.TemporaryDirectory(prefix="hetjax-bench-ckpt-") as directory:
    tr = build(directory, async_save)
    for _ in range(3):  # Compilation and the first save's one-time setup.
      tr.train_step()
    tr.save_checkpoint()  # Compiles the snapshot's copy when async.
    tr.checkpointer.wait()
    times, saved, blocking = [], [], []
    tr.checkpointer.handover_s.clear()
    tr.checkpointer.snapshot_s.clear()
    tr.checkpointer.handover_wait_s.clear()
    for i in range(steps):
      t0 = time.perf_counter()
      tr.train_step()
      if i % every == every - 1:
        t1 = time.perf_counter()
        # Includes applying the step's own update, which otherwise runs in the
        # next step's first program: a save needs it applied first.
        tr.save_checkpoint(wait=not async_save)
        blocking.append(time.perf_counter() - t1)
        saved.append(i)
      times.append(time.perf_counter() - t0)
    tr.close()
    handover = tr.checkpointer.handover_s or blocking  # Sync saves hand over in the call.
    snapshot = tr.checkpointer.snapshot_s or [0.0]  # Sync saves take no snapshot.
    waited = tr.checkpointer.handover_wait_s or [0.0]  # Nor wait for an earlier hand-over.
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(directory) for f in fs)
  touched = {j for i in saved for j in (i, i + 1)}
  plain = statistics.median(t for j, t in enumerate(times) if j not in touched)
  stalls = [times[i] + (times[i + 1] if i + 1 < len(times) else plain) - 2 * plain for i in saved]
  return {"step_s": plain, "stall_s": statistics.median(stalls),
          "stall_fraction": statistics.median(stalls) / plain, "saves": len(saved),
          "blocking_s": statistics.median(blocking),
          "blocking_fraction": statistics.median(blocking) / plain,
          "handover_s": statistics.median(handover),
          "snapshot_s": statistics.median(snapshot),
          # The part of the blocking spent waiting for the previous save's
          # hand-over: saves closer together than a hand-over.
          "handover_wait_s": statistics.median(waited),
          "next_step_extra_s": statistics.median(
              times[i + 1] - plain for i in saved if i + 1 < len(times)),
          "checkpoint_mb": size / 2 ** 20 / max(1, len(saved) + 1)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--every", type=int, default=8)
  p.add_argument("--global-batch", type=int, default=32)
  args = p.parse_args(argv)
  hetjax.initialize()
  print(f"1 host, CPU (shared 2-core machine): save every {args.every} steps, {args.steps} steps "
        "per run; stall = extra wall time of the saving step and the next, over two median steps.")
  result = {}
  for model in MODELS:
    for mode in ("async", "sync"):
      build = functools.partial(_trainer, model, args.global_batch)
      r = measure(build, mode == "async", args.steps, args.every)
      result[f"{model}_{mode}"] = r
      where = "on a worker" if mode == "async" else "in the call"
      print(f"{model:12s} {mode:5s} step {r['step_s'] * 1e3:7.1f} ms  save call blocks "
            f"{r['blocking_s'] * 1e3:6.1f} ms = {r['blocking_fraction']:.1%} of a step "
            f"(snapshot {r['snapshot_s'] * 1e3:5.1f} ms; waiting for the previous hand-over "
            f"{r['handover_wait_s'] * 1e3:5.1f} ms; orbax hand-over {where} "
            f"{r['handover_s'] * 1e3:6.1f} ms; next step +{r['next_step_extra_s'] * 1e3:6.1f} ms); "
            f"stall per save {r['stall_s'] * 1e3:7.1f} ms = {r['stall_fraction']:.1%}  "
            f"(~{r['checkpoint_mb']:.1f} MB per checkpoint)")
    ratio = result[f"{model}_async"]["stall_s"] / max(result[f"{model}_sync"]["stall_s"], 1e-9)
    result[f"{model}_async_over_sync"] = ratio
    print(f"{model:12s} async stall / sync stall = {ratio:.2f}")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
