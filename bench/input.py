"""Does the input pipeline outrun the step it feeds? Samples/s side by side.

Run from the repository root:

  .venv/bin/python bench/input.py [--batch 96] [--steps 50] [--repeats 5] [--threads 2]
      [--image-sizes 64,224] [--workers 1,2] [--jpeg-batch 32] [--jpeg-records 2048]
      [--photo-sizes 160-512] [--model-steps 2] [--skip-arrays]

For each dataset, one host's `HostLoader` delivers `--batch` records per step
in the trainer's pattern (`get(s)`, then `prefetch(s + 1)` with the same
shares) as fast as it can; a plain `jax.jit` CNN train step
(`zoo.build("cnn", ...)`, adam, mean loss, device-resident batch,
blocking on the loss) consumes batches of the same size and shape. Each
repeat times both back to back; the ratio pipeline / consumption is the median
of the per-repeat ratios and must be >= 2 for "digits" and "synthetic_big".
Two more rows are for information: digits with `--augment crop,flip`, and
digits written as an array_record TFDS dataset in a temporary folder and read
back through `tfds.data_source` (per-record deserialisation).

The JPEG rows build `--jpeg-records` synthetic photos of random
sizes (160-512 pixels a side, JPEG quality 90) as a TFDS array_record
dataset, then for each `--image-sizes` S: the decode cost per image (one
process, the training recipe: decode, random resized crop to S, flip), the
samples/s the loader delivers with each of `--workers` worker processes, and
the samples/s of a plain jitted `resnet18` train step on S x S uint8 batches
of `--jpeg-batch`, side by side. The last line printed is one JSON object
with the figures.
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

from hetjax import models as zoo
from hetjax.input import augment
from hetjax.input import data
from hetjax.input import loader
from hetjax.input import tfds_data

REQUIRED = ("digits", "synthetic_big")
TARGET = 2.0
SEED = 0


def _consumer(source: data.Source, batch: int, model: str = "cnn") -> Callable[[], None]:
  """One plain jitted train step of `model` on a fixed device batch, per call."""
  task = zoo.build(model, kind="image", num_classes=source.info.num_classes)
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


class _Photos:
  """`count` deterministic photo-like uint8 images of random sizes, made on demand."""

  def __init__(self, count: int, sizes: tuple[int, int] = (160, 512), seed: int = 0):
    self.count, self.sizes, self.seed = count, sizes, seed

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, i: int) -> np.ndarray:
    from PIL import Image

    rng = np.random.default_rng([self.seed, i])
    h, w = (int(v) for v in rng.integers(self.sizes[0], self.sizes[1] + 1, size=2))
    coarse = Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((w, h), Image.BICUBIC), np.float32)
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)


def _jpeg_photos(folder: str, records: int, sizes: tuple[int, int]) -> str:
  """Builds the synthetic JPEG dataset in `folder`; returns its `tfds:` name."""
  labels = np.arange(records) % 1000
  t0 = time.perf_counter()
  path = tfds_data.build_from_arrays(
      "bench_photos", {"train": {"image": _Photos(records, sizes), "label": labels}}, folder,
      image_format="jpeg")
  megabytes = sum(f.stat().st_size for f in path.iterdir()) / 2**20
  print(f"built {records:,} JPEG photos of {sizes[0]}-{sizes[1]} px in {time.perf_counter() - t0:.0f} s "
        f"({megabytes:,.0f} MiB of array_record)")
  return "tfds:bench_photos"


def _jpeg_rows(args: argparse.Namespace, folder: str) -> dict[str, Any]:
  """Decode cost, pipeline samples/s per worker count, and the resnet18 step, per image size."""
  name = _jpeg_photos(folder, args.jpeg_records, args.photo_sizes)
  batch, figures = args.jpeg_batch, {}
  lo, hi = args.photo_sizes
  print(f"JPEG photos ({args.jpeg_records} records, {lo}-{hi} px), batch {batch}, recipe crop,flip:")
  print(f"{'size':>5} {'decode ms/img':>14} " + " ".join(f"{f'{w} worker(s) smp/s':>18}" for w in args.workers)
        + f" {'resnet18 smp/s':>15} {'ratio (most workers)':>21}")
  for size in args.image_sizes:
    source = data.load(name, data_dir=folder, image_size=size, augment="crop,flip")
    sampler = data.GlobalSampler(len(source), batch, SEED, name=source.info.name)
    indices = sampler.indices(0)
    keys = augment.example_keys(SEED, np.zeros(batch, np.int64), indices)
    source.train_records(indices, keys)  # Warm the files.
    t0 = time.perf_counter()
    source.train_records(indices, keys)
    decode_ms = (time.perf_counter() - t0) / batch * 1e3
    rates = {}
    for workers in args.workers:
      with loader.HostLoader(source, sampler, 0, workers=workers) as host:
        produce = _producer(host, batch)
        _rate(produce, 2, batch)  # Warm-up: the workers start.
        rates[workers] = statistics.median(_rate(produce, args.jpeg_steps, batch)
                                           for _ in range(args.repeats))
    step = ratio = float("nan")
    if args.model_steps:
      consume = _consumer(source, batch, model="resnet18")
      _rate(consume, 1, batch)  # Compilation.
      step = statistics.median(_rate(consume, args.model_steps, batch) for _ in range(args.repeats))
      ratio = rates[max(args.workers)] / step
    figures[f"jpeg@{size}"] = {"decode_ms_per_image": round(decode_ms, 3),
                               "pipeline_samples_per_sec": {w: round(r, 1) for w, r in rates.items()},
                               "resnet18_samples_per_sec": round(step, 1), "ratio": round(ratio, 2)}
    print(f"{size:>5} {decode_ms:>14.2f} " + " ".join(f"{rates[w]:>18,.1f}" for w in args.workers)
          + f" {step:>15,.1f} {ratio:>21.2f}", flush=True)
  return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--batch", type=int, default=96, help="records per step for this host")
  p.add_argument("--steps", type=int, default=50, help="timed steps per side per repeat")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--threads", type=int, default=2, help="loader threads")
  p.add_argument("--jpeg-records", type=int, default=2048, help="synthetic JPEG photos to build")
  p.add_argument("--jpeg-batch", type=int, default=32, help="records per step in the JPEG rows")
  p.add_argument("--jpeg-steps", type=int, default=8, help="timed loader steps per JPEG repeat")
  p.add_argument("--model-steps", type=int, default=2,
                 help="timed resnet18 steps per repeat (0: no model rows)")
  p.add_argument("--photo-sizes", type=lambda v: tuple(int(x) for x in v.split("-")),
                 default=(160, 512), help="smallest-largest side of the synthetic photos, e.g. 20-96")
  p.add_argument("--image-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[64, 224])
  p.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                 help="worker process counts to compare in the JPEG rows")
  p.add_argument("--skip-arrays", action="store_true", help="only the JPEG rows")
  args = p.parse_args(argv)
  cpus = os.cpu_count()
  print(f"input pipeline vs CNN step: batch={args.batch} steps={args.steps} repeats={args.repeats} "
        f"threads={args.threads}; jax {jax.__version__} on {jax.devices()[0].platform}. Figures come "
        f"from a shared {cpus}-core CPU (other jobs may run beside it): compare within a row.")
  with tempfile.TemporaryDirectory(prefix="hetjax-bench-input-") as folder:
    jpeg = _jpeg_rows(args, folder)
    rows = {} if args.skip_arrays else {"digits": (data.load("digits"), None),
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
  ok = all(figures[n]["ratio"] >= TARGET for n in REQUIRED if n in figures)
  if figures:
    print(f"pipeline / consumption >= {TARGET} for {', '.join(REQUIRED)}: {'yes' if ok else 'NO'}")
  result = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats,
            "threads": args.threads, "cpus": cpus, "target": TARGET, "ok": ok, "rows": figures,
            "jpeg": jpeg}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
