"""Does the input pipeline outrun the step it feeds? Samples/s side by side.

Run from the repository root:

  .venv/bin/python bench/input.py [--batch 96] [--steps 50] [--repeats 5] [--threads 2]

For each dataset, one host's `HostLoader` delivers `--batch` records per step
in the trainer's pattern (`get(s)`, then `prefetch(s + 1)` with the same
shares) as fast as it can; a plain `jax.jit` CNN train step
(`hetjax_models.build("cnn", ...)`, adam, mean loss, device-resident batch,
blocking on the loss) consumes batches of the same size and shape. Each
repeat times both back to back; the ratio pipeline / consumption is the median
of the per-repeat ratios and must be >= 2 for "digits" and "synthetic_big".
Two more rows are for information: digits with `--augment crop,flip`, and
digits written as an array_record TFDS dataset in a temporary folder and read
back through `tfds.data_source` (per-record deserialisation). The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax_models
from hetjax import augment, data, loader, tfds_data

REQUIRED = ("digits", "synthetic_big")
TARGET = 2.0
SEED = 0


def _consumer(source: data.Source, batch: int) -> Callable[[], None]:
  """One plain jitted CNN train step on a fixed device batch, per call."""
  task = hetjax_models.build("cnn", kind="image", num_classes=source.info.num_classes)
  host = source[np.arange(batch) % len(source)]
  device = jax.device_put({"x": host["x"], "y": host["y"], "mask": np.ones(batch, np.float32)})
  key = jax.random.key(SEED)
  params, model_state = jax.jit(task.init)(key, device)
  optimizer = optax.adam(1e-3)
  state = {"params": params, "opt": optimizer.init(params)}

  @jax.jit
  def step(state, batch):
    def mean_loss(p):
      losses, _, _ = task.loss(p, model_state, batch, key)
      return jnp.mean(losses)

    loss, grads = jax.value_and_grad(mean_loss)(state["params"])
    updates, opt = optimizer.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  def run() -> None:
    nonlocal state
    state, loss = step(state, device)
    loss.block_until_ready()

  return run


def _producer(host: loader.HostLoader, batch: int) -> Callable[[], None]:
  """Delivers the next step's batch the way the trainer asks for it."""
  shares, step = (batch,), 0

  def run() -> None:
    nonlocal step
    got = host.get(step, shares)
    assert len(got["y"]) == batch
    host.prefetch(step + 1, shares)
    step += 1

  return run


def _rate(fn: Callable[[], None], steps: int, batch: int) -> float:
  t0 = time.perf_counter()
  for _ in range(steps):
    fn()
  return batch * steps / (time.perf_counter() - t0)


def _tfds_digits(folder: str) -> data.Source:
  """sklearn digits written as array_record files, read back through TFDS."""
  import tensorflow_datasets as tfds

  digits = data.load("digits")
  tfds_data.build_from_arrays(
      "bench_digits", {"train": digits.arrays}, folder,
      features={"x": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.float32),
                "y": tfds.features.ClassLabel(num_classes=10)})
  return data.load("tfds:bench_digits", data_dir=folder)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--batch", type=int, default=96, help="records per step for this host")
  p.add_argument("--steps", type=int, default=50, help="timed steps per side per repeat")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--threads", type=int, default=2, help="loader threads")
  args = p.parse_args(argv)
  cpus = os.cpu_count()
  print(f"input pipeline vs CNN step: batch={args.batch} steps={args.steps} repeats={args.repeats} "
        f"threads={args.threads}; jax {jax.__version__} on {jax.devices()[0].platform}. Figures come "
        f"from a shared {cpus}-core CPU (other jobs may run beside it): compare within a row.")
  with tempfile.TemporaryDirectory(prefix="hetjax-bench-input-") as folder:
    rows = {"digits": (data.load("digits"), None),
            "synthetic_big": (data.load("synthetic_big"), None),
            "digits+crop,flip": (data.load("digits"), augment.parse("crop,flip")),
            "tfds:digits": (_tfds_digits(folder), None)}
    print(f"{'dataset':>18} {'pipeline smp/s':>15} {'step smp/s':>12} {'ratio':>7}")
    figures = {}
    for name, (source, aug) in rows.items():
      sampler = data.GlobalSampler(len(source), args.batch, SEED, name=source.info.name)
      consume = _consumer(source, args.batch)
      with loader.HostLoader(source, sampler, 0, threads=args.threads, augment=aug) as host:
        produce = _producer(host, args.batch)
        for fn in (produce, consume):
          _rate(fn, 5, args.batch)  # Warm-up: compilation, first reads.
        rates = [(_rate(produce, args.steps, args.batch), _rate(consume, args.steps, args.batch))
                 for _ in range(args.repeats)]
      pipe, step = statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)
      ratio = statistics.median(r[0] / r[1] for r in rates)
      figures[name] = {"pipeline_samples_per_sec": round(pipe), "step_samples_per_sec": round(step),
                       "ratio": round(ratio, 2)}
      note = "" if name in REQUIRED else "  (information)"
      print(f"{name:>18} {pipe:>15,.0f} {step:>12,.0f} {ratio:>7.2f}{note}", flush=True)
  ok = all(figures[n]["ratio"] >= TARGET for n in REQUIRED)
  print(f"pipeline / consumption >= {TARGET} for {', '.join(REQUIRED)}: {'yes' if ok else 'NO'}")
  result = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats,
            "threads": args.threads, "cpus": cpus, "target": TARGET, "ok": ok, "rows": figures}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
