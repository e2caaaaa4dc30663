"""What it takes to feed a GPU: decode per core, loader samples/s, and the step they feed.

Run from the repository root:

  .venv/bin/python bench/input.py [--batch 96] [--steps 50] [--repeats 5] [--threads 2]
      [--image-sizes 224] [--workers 1,2] [--jpeg-batch 32] [--jpeg-records 512]
      [--jpeg-steps 16] [--decode-images 200] [--model-steps 2] [--skip-arrays]

1. Decode per core, natural JPEGs (scikit-learn's china.jpg and flower.jpg,
   640x427 as shipped, and the same photos resized to 500x375 and
   re-encoded at quality 90, ImageNet's most common size): per image, one
   process, the training recipe (Inception crop to 224, flip), hetjax's
   `ImageSource.train_records` side by side with the field's fast path
   (simplejpeg full decode, the same crop box, OpenCV bilinear resize, flip)
   and with PIL (hetjax's recipe before issue 53), interleaved, median of
   `--repeats`. hetjax / field must be <= 1.1.
2. The loader on those photos (`--jpeg-records` records as a TFDS
   array_record dataset, crop,flip), in the trainer's pattern: samples/s
   with each of `--workers` worker processes, the loaders timed in turn
   after 2 s of warm-up each, scaling the median of per-round ratios
   (2 / 1 should be >= 1.7 where two cores are free); CPU ms per batch of
   the host process and of the workers (from /proc, so load does not
   inflate it: their sum over the cores bounds the scaling); the same
   decoding in 1 and 2 plain processes, timed in the same rounds, no
   loader (what the machine gives at that moment); and a plain jitted
   resnet18 step on the same batches.
3. Cores a host needs to feed ResNet-50 at NVIDIA's published per-GPU
   training rates, derived from (1): rate x ms per image.
4. In-memory and TFDS sources against a CNN step: one host's `HostLoader`
   delivers `--batch` records per step in the trainer's pattern (`get(s)`,
   then `prefetch(s + 1)`; slices under 2 ms read inline, as in training), a plain `jax.jit` CNN step (adam, mean loss,
   device-resident batch) consumes batches of that size; the ratio is the
   median of per-repeat ratios and must be >= 2 for digits, synthetic_big
   and tfds:digits (digits as an array_record TFDS dataset, read by
   array_record's own reader).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
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
from hetjax.input import images
from hetjax.input import loader
from hetjax.input import tfds_data

REQUIRED = ("digits", "synthetic_big", "tfds:digits")
DECODE_TARGET = 1.1  # hetjax / field, per image, at most.
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


# NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README (pytorch-21.03), mixed precision,
# 8 GPUs: DGX A100 80GB 16,621 img/s, DGX-1 V100 16GB 8,322 img/s; per GPU below.
PUBLISHED_RESNET50 = {"A100": 16621 / 8, "V100": 8322 / 8}
IMAGENET_ROW = "500x375 q90"  # ImageNet's most common size and 4:2:0 chroma (the shipped are 4:4:4).


def _natural_photos() -> dict[str, list[bytes]]:
  """scikit-learn's two JPEG photos as shipped (640x427) and at 500x375, re-encoded at quality 90."""
  import io

  import sklearn.datasets
  from PIL import Image

  folder = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")
  shipped = [open(os.path.join(folder, f), "rb").read() for f in ("china.jpg", "flower.jpg")]

  def resized(blob: bytes, w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(blob)).resize((w, h), Image.LANCZOS).save(out, "JPEG", quality=90)
    return out.getvalue()

  return {"640x427 shipped": shipped, IMAGENET_ROW: [resized(b, 500, 375) for b in shipped]}


def _field_recipe(blobs: list[bytes], size: int, draws: np.ndarray, flips: np.ndarray) -> np.ndarray:
  """The field's fast path into a batch: simplejpeg full decode, the same box, OpenCV bilinear, flip."""
  import cv2
  import simplejpeg

  x = np.empty((len(blobs), size, size, 3), np.uint8)
  for i, blob in enumerate(blobs):
    image = simplejpeg.decode_jpeg(blob, "RGB")
    left, top, right, bottom = images.random_crop_box(image.shape[1], image.shape[0], draws[i])
    out = cv2.resize(image[top:bottom, left:right], (size, size), interpolation=cv2.INTER_LINEAR)
    x[i] = out[:, ::-1] if flips[i] else out
  return x


def _pil_recipe(blobs: list[bytes], size: int, draws: np.ndarray, flips: np.ndarray) -> np.ndarray:
  """hetjax's recipe before issue 53: PIL decode at a DCT scale (`draft`), antialiased bilinear."""
  x = np.empty((len(blobs), size, size, 3), np.uint8)
  for i, blob in enumerate(blobs):
    out = images._decode_pil(blob, size, 3, lambda w, h, d=draws[i]: images.random_crop_box(w, h, d))
    x[i] = out[:, ::-1] if flips[i] else out
  return x


def _decode_rows(args: argparse.Namespace) -> dict[str, Any]:
  """ms per image on one process: hetjax's recipe, the field's, PIL's, in alternating blocks of 8."""
  import cv2
  cv2.setNumThreads(1)  # One core, as each loader worker has.
  n, size, block, figures = args.decode_images, 224, 8, {}
  keys = augment.example_keys(SEED, np.zeros(n, np.int64), np.arange(n))
  draws = images._uniform(keys, images._CROP_STREAM, 4 * images._ATTEMPTS)
  flips = images._uniform(keys, images._FLIP_STREAM, 1)[:, 0] < 0.5
  print(f"decode per image, one process, crop,flip to {size} px, {n} images per side per repeat:")
  print(f"{'photos':>16} {'hetjax ms':>10} {'field ms':>9} {'PIL ms':>7} {'hetjax/field':>13}")
  for name, blobs in _natural_photos().items():
    records = [blobs[i % 2] for i in range(n)]
    encoded = data.ArraySource({"image": np.array(records, object), "label": np.zeros(n, np.int32)},
                               data.DatasetInfo(name, "image", 1))
    source = images.ImageSource(encoded, images.ImageRecipe(size, 3, crop=True, flip=True))
    sides = {
        "hetjax": lambda s: source.train_records(np.arange(s.start, s.stop), keys[s]),
        "field": lambda s: _field_recipe(records[s], size, draws[s], flips[s]),
        "pil": lambda s: _pil_recipe(records[s], size, draws[s], flips[s])}
    totals = {k: [] for k in sides}
    for _ in range(args.repeats + 1):  # The first round warms caches and is dropped.
      spent = dict.fromkeys(sides, 0.0)
      for start in range(0, n, block):
        for k, fn in sides.items():
          t0 = time.perf_counter()
          fn(slice(start, min(n, start + block)))
          spent[k] += time.perf_counter() - t0
      for k in sides:
        totals[k].append(spent[k] / n * 1e3)
    ms = {k: statistics.median(v[1:]) for k, v in totals.items()}
    ratio = statistics.median(h / f for h, f in zip(totals["hetjax"][1:], totals["field"][1:]))
    figures[name] = {"hetjax_ms": round(ms["hetjax"], 3), "field_ms": round(ms["field"], 3),
                     "hetjax_best_ms": round(min(totals["hetjax"][1:]), 3),
                     "pil_ms": round(ms["pil"], 3), "hetjax_over_field": round(ratio, 3)}
    print(f"{name:>16} {ms['hetjax']:>10.2f} {ms['field']:>9.2f} {ms['pil']:>7.2f} {ratio:>13.2f}",
          flush=True)
  return figures


def _jpeg_dataset(folder: str, records: int) -> str:
  """The natural photos at both sizes, cycled, as a TFDS array_record dataset; its `tfds:` name."""
  import io

  from PIL import Image
  blobs = [b for group in _natural_photos().values() for b in group]
  photos = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs]
  tfds_data.build_from_arrays(
      "bench_photos", {"train": {"image": [photos[i % len(photos)] for i in range(records)],
                                 "label": np.arange(records) % 1000}}, folder, image_format="jpeg")
  return "tfds:bench_photos"


def _cpu_s(pid: int) -> float:
  """CPU seconds (user + system) a process has used, from /proc: what machine load cannot inflate."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(produce: Callable[[], None], host: loader.HostLoader, steps: int, batch: int
           ) -> tuple[float, float, float]:
  """Samples/s, and CPU ms per batch of the host process and of its workers together."""
  pids = [p.pid for p in host._pool._processes.values()]
  cpu0 = [_cpu_s(os.getpid())] + [_cpu_s(p) for p in pids]
  rate = _rate(produce, steps, batch)
  cpu = [(_cpu_s(p) - c) * 1e3 / steps for p, c in zip([os.getpid()] + pids, cpu0)]
  return rate, cpu[0], sum(cpu[1:])


_PLAIN: tuple = ()  # (source, sampler) in a plain decode process.


def _plain_start(source: data.Source, sampler: data.GlobalSampler) -> None:
  global _PLAIN
  _PLAIN = (source, sampler)


def _plain_read(step: int) -> int:
  """A step's batch read and decoded as a loader worker does, then dropped (no hand-over)."""
  return len(loader.read_records(*_PLAIN, None, step, 0, _PLAIN[1].global_batch)["y"])


def _plain_rate(pool: concurrent.futures.Executor, steps: int, batch: int) -> float:
  """Samples/s of plain processes decoding `steps` batches, no barrier between batches."""
  t0 = time.perf_counter()
  assert sum(pool.map(_plain_read, range(steps))) == steps * batch
  return steps * batch / (time.perf_counter() - t0)


def _jpeg_rows(args: argparse.Namespace, folder: str) -> dict[str, Any]:
  """Loader samples/s per worker count (the loaders timed in turn, so load drifting on a shared
  machine hits both sides of each ratio), and the resnet18 step, per image size."""
  name = _jpeg_dataset(folder, args.jpeg_records)
  batch, figures = args.jpeg_batch, {}
  print(f"loader on the natural photos ({args.jpeg_records} records, batch {batch}, crop,flip; "
        f"CPU ms per batch: host process + workers):")
  print(f"{'size':>5} " + " ".join(f"{f'{w} worker(s) smp/s':>18} {'CPU ms':>11}" for w in args.workers)
        + f" {'scaling':>8} {'resnet18 smp/s':>15}")
  for size in args.image_sizes:
    source = data.load(name, data_dir=folder, image_size=size, augment="crop,flip")
    sampler = data.GlobalSampler(len(source), batch, SEED, name=source.info.name)
    hosts = {w: loader.HostLoader(source, sampler, 0, workers=w) for w in args.workers}
    spawn = multiprocessing.get_context("spawn")
    plain = {w: concurrent.futures.ProcessPoolExecutor(w, spawn, _plain_start, (source, sampler))
             for w in args.workers}
    try:
      produce = {w: _producer(host, batch) for w, host in hosts.items()}
      for w, fn in produce.items():  # Warm-up: every process started, its libraries loaded.
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
          fn()
          _plain_rate(plain[w], w, batch)
      rounds = [{w: (*_timed(fn, hosts[w], args.jpeg_steps, batch),
                     _plain_rate(plain[w], args.jpeg_steps, batch)) for w, fn in produce.items()}
                for _ in range(args.repeats)]
    finally:
      for host in hosts.values():
        host.close()
      for pool in plain.values():
        pool.shutdown(cancel_futures=True)
    rates = {w: statistics.median(r[w][0] for r in rounds) for w in args.workers}
    cpu = {w: [statistics.median(r[w][i] for r in rounds) for i in (1, 2)] for w in args.workers}
    lo, hi = min(args.workers), max(args.workers)
    scaling = statistics.median(r[hi][0] / r[lo][0] for r in rounds)
    ceiling = statistics.median(r[hi][3] / r[lo][3] for r in rounds)
    step = float("nan")
    if args.model_steps:
      consume = _consumer(source, batch, model="resnet18")
      _rate(consume, 1, batch)  # Compilation.
      step = statistics.median(_rate(consume, args.model_steps, batch) for _ in range(args.repeats))
    figures[f"jpeg@{size}"] = {"pipeline_samples_per_sec": {w: round(r, 1) for w, r in rates.items()},
                               "cpu_ms_per_batch_host_workers": {
                                   w: [round(c, 1) for c in cpu[w]] for w in args.workers},
                               "scaling": round(scaling, 2),
                               "plain_processes_scaling": round(ceiling, 2),
                               "resnet18_samples_per_sec": round(step, 1)}
    print(f"{size:>5} " + " ".join(f"{rates[w]:>18,.1f} {cpu[w][0]:>5.1f}+{cpu[w][1]:<5.1f}"
                                   for w in args.workers) + f" {scaling:>8.2f} {step:>15,.1f}")
    plain_rates = {w: statistics.median(r[w][3] for r in rounds) for w in args.workers}
    print(f"      plain decode processes, same rounds (what the machine gives now): "
          + ", ".join(f"{w}: {r:,.1f}" for w, r in plain_rates.items())
          + f" smp/s, scaling {ceiling:.2f}", flush=True)
  return figures


def _cores_to_feed(decode: dict[str, Any]) -> dict[str, Any]:
  """Derived, not measured: published ResNet-50 img/s per GPU x hetjax's ms per image."""
  ms = decode[IMAGENET_ROW]["hetjax_best_ms"]
  print(f"cores to feed ResNet-50 at NVIDIA's published per-GPU rates (derived: rate x {ms:.2f} ms, "
        f"the {IMAGENET_ROW} row's least disturbed repeat; decode only, no file reads):")
  cores = {}
  for gpu, rate in PUBLISHED_RESNET50.items():
    cores[gpu] = {"img_per_sec_per_gpu": round(rate), "cores_per_gpu": round(rate * ms / 1e3, 1),
                  "cores_per_8_gpus": round(8 * rate * ms / 1e3)}
    print(f"  {gpu}: {rate:,.0f} img/s per GPU -> {cores[gpu]['cores_per_gpu']} cores per GPU, "
          f"{cores[gpu]['cores_per_8_gpus']} for eight", flush=True)
  return cores


def main(argv: list[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--batch", type=int, default=96, help="records per step for this host")
  p.add_argument("--steps", type=int, default=50, help="timed steps per side per repeat")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--threads", type=int, default=2, help="loader threads")
  p.add_argument("--jpeg-records", type=int, default=512, help="photos in the loader's dataset")
  p.add_argument("--jpeg-batch", type=int, default=32, help="records per step in the JPEG rows")
  p.add_argument("--jpeg-steps", type=int, default=16, help="timed loader steps per JPEG repeat")
  p.add_argument("--decode-images", type=int, default=200, help="images per side in the decode rows")
  p.add_argument("--model-steps", type=int, default=2,
                 help="timed resnet18 steps per repeat (0: no model rows)")
  p.add_argument("--image-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[224])
  p.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                 help="worker process counts to compare in the JPEG rows")
  p.add_argument("--skip-arrays", action="store_true", help="only the JPEG rows")
  args = p.parse_args(argv)
  cpus = os.cpu_count()
  print(f"bench/input.py: batch={args.batch} steps={args.steps} repeats={args.repeats} "
        f"threads={args.threads}; jax {jax.__version__} on {jax.devices()[0].platform}. Figures come "
        f"from a shared {cpus}-core CPU (other jobs may run beside it): compare within a row.")
  decode = _decode_rows(args)
  cores = _cores_to_feed(decode)
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
      # As training builds it (modes/sync.py): slices that read in under 2 ms read inline.
      with loader.HostLoader(source, sampler, 0, threads=args.threads, augment=aug,
                             inline_below_s=loader.INLINE_BELOW_S) as host:
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
  decode_ok = all(r["hetjax_over_field"] <= DECODE_TARGET for r in decode.values())
  print(f"hetjax / field decode <= {DECODE_TARGET} per image: {'yes' if decode_ok else 'NO'}")
  result = {"batch": args.batch, "steps": args.steps, "repeats": args.repeats,
            "threads": args.threads, "cpus": cpus, "target": TARGET, "ok": ok and decode_ok,
            "rows": figures, "decode": decode, "cores_to_feed_resnet50_derived": cores, "jpeg": jpeg}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
