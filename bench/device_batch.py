"""Device batches against single blocks: samples/s of `k` blocks per device over `k = 1`.

Run from the repository root (a few minutes):

  .venv/bin/python bench/device_batch.py [--models cnn,resnet18] [--device-batch 8] \
      [--microbatch 4] [--global-batch 128] [--steps 10] [--repeats 7]

Real compute, no emulated pacing: 1 host x 2 XLA:CPU devices
(`--xla_force_host_platform_device_count=2`, set here before JAX loads),
`hetjax.Trainer(...).fit(N)` on sklearn digits with `optax.adam(1e-3)`.
Two trainers per model differ only in `TrainConfig.device_batch`: `1` (a
micro-batch of one block of `--microbatch` samples per device) and `k`
(`k` blocks per device at once, kept apart, so the math is the same). After
a warm-up that compiles every program, the script repeats R times {N steps
with k; N steps with 1}, each timed run ending when its results are ready,
and reports per model the median of the per-repeat samples/s ratios
(interleaving cancels machine noise) with their quartiles. The last line
printed is one JSON object: `{model: ratio}`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import hetjax  # noqa: E402
from hetjax import models as zoo  # noqa: E402
from hetjax.input import data as data_lib  # noqa: E402


def _trainer(model: str, k: int, args: argparse.Namespace) -> hetjax.Trainer:
  source = data_lib.load("digits")
  task = zoo.build(model, kind="image", num_classes=10)
  config = hetjax.TrainConfig(global_batch=args.global_batch, microbatch=args.microbatch,
                              device_batch=k, check_every=0)
  return hetjax.Trainer(task, optax.adam(1e-3), source, config)


def _samples_per_s(tr: hetjax.Trainer, steps: int, global_batch: int) -> float:
  start = time.perf_counter()
  tr.fit(steps)
  jax.block_until_ready(tr.params())
  return steps * global_batch / (time.perf_counter() - start)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="cnn,resnet18")
  p.add_argument("--device-batch", type=int, default=8)
  p.add_argument("--microbatch", type=int, default=4)
  p.add_argument("--global-batch", type=int, default=128)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  assert jax.local_device_count() == 2, jax.devices()
  k = args.device_batch
  out = {}
  for model in args.models.split(","):
    trainers = {j: _trainer(model, j, args) for j in (k, 1)}
    for tr in trainers.values():  # Warm-up: compiles every program of each ladder.
      tr.fit(2)
    ratios = []
    for _ in range(args.repeats):
      sps = {j: _samples_per_s(tr, args.steps, args.global_batch) for j, tr in trainers.items()}
      ratios.append(sps[k] / sps[1])
    for tr in trainers.values():
      tr.close()
    q = np.percentile(ratios, [25, 75])
    out[model] = round(statistics.median(ratios), 3)
    print(f"{model}: device batch {k} / 1 = {out[model]:.3f}x samples/s "
          f"(quartiles {q[0]:.3f}-{q[1]:.3f}, {args.repeats} repeats of {args.steps} steps, "
          f"global batch {args.global_batch}, microbatch {args.microbatch}, 2 devices)",
          flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
