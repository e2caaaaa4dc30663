"""Per-device peak bytes and step time with and without sharding within a host.

Run from the repository root (a few minutes on 2 cores):

  .venv/bin/python bench/memory.py [--devices 4] [--steps 5] [--parts structures,gspmd,...]

Every figure of bytes is XLA:CPU's `compiled.memory_analysis()` of the
compiled local program (arguments + outputs not aliased + temporaries, per
device), on one host of `--devices` emulated CPU devices: what a GPU's
compiler would hold differs, the ratio is the point. Step times are
XLA:CPU's, on emulated devices that share the machine's cores: a gather
there is a memory copy, not a link, so they say little about a GPU.

Printed, as JSON lines:
- `structure`: the decoder of tests/_layer_models.py (width 256, 4 layers,
  tied embeddings) with its layers stacked by `nn.scan(nn.remat(Block))`,
  in a Python loop, and scanned under a jitted loss (device batches 4), and
  the NNX decoder (`nnx.vmap` + `nnx.scan`; each layer gathers its own too):
  a device's step peak (the largest program a step runs,
  `LocalProgram.peak_bytes`) with `--shard-within-host off` and `on`.
- `model`: resnet50 (32x32 digits, --microbatch 4) and the transformer, each
  with sharding off and on: the step peak and the median step time.
- `fits`: the largest transformer width (d_model, `LAYERS` layers, the
  tokens data) whose step fits 16 GB and 80 GB devices, with and without
  sharding: peaks measured at small widths, fitted as `a W^2 + b W + c`
  (parameters grow as W^2, activations as W) and solved; an extrapolation
  from the same analysis, said so.
- `gspmd`: the scanned decoder's gradient with its parameters split on the
  same axes, left to GSPMD (sharding annotations only): its peak, and
  whether XLA gathered parameters or activations (the design's check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def _setup(devices: int) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={devices}")


def _trainer(model: str, mode: str, width: int | None = None, layers: int = 2):
  import numpy as np
  import optax
  from hetjax import models as zoo
  from hetjax import trainer
  from hetjax.input import data
  if model == "resnet50":
    digits = data.load("digits")
    upscale = lambda x: np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)
    source = data.ArraySource({"x": upscale(digits.arrays["x"]), "y": digits.arrays["y"]},
                              digits.info)
    task = zoo.build("resnet50", kind="image", num_classes=10)
  else:
    source = data.load("tokens")
    task = zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size,
                     d_model=width or 256, num_layers=layers)
  config = trainer.TrainConfig(global_batch=16, microbatch=4, shard_within_host=mode)
  return trainer.Trainer(task, optax.sgd(0.01), source, config)


def _peaks(tr) -> dict[str, int]:
  return {"step_peak": tr.mode.local.peak_bytes()}


def structures(devices: int) -> None:
  import optax
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import _layer_models as layer_models
  from hetjax import trainer
  from hetjax.input import data
  for structure, k in (("scan", 1), ("loop", 1), ("jit", 4), ("nnx", 1)):
    peaks = {}
    for mode in ("off", "on"):
      config = trainer.TrainConfig(global_batch=32, microbatch=2, shard_within_host=mode,
                                   device_batch=k)
      tr = trainer.Trainer(layer_models.decoder(structure), optax.sgd(0.1), data.load("tokens"),
                           config)
      tr.fit(2)  # The second step unpacks the sharded update's result.
      peaks[mode] = tr.mode.local.peak_bytes()
      tr.close()
    print(json.dumps({"structure": structure, "device_batch": k, "devices": devices,
                      "step_peak_off": peaks["off"], "step_peak_on": peaks["on"],
                      "ratio": round(peaks["on"] / peaks["off"], 3),
                      "source": "XLA:CPU memory_analysis, emulated devices"}), flush=True)


def measure(model: str, steps: int, width: int | None = None, layers: int = 2) -> None:
  import numpy as np
  for mode in ("off", "on"):
    tr = _trainer(model, mode, width, layers)
    tr.fit(2)  # Compiles every program.
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      tr.fit(1)
      tr.mode.block_until_ready()
      times.append(time.perf_counter() - start)
    print(json.dumps({"model": model, "width": width, "shard_within_host": mode, **_peaks(tr),
                      "step_s": round(float(np.median(times)), 4),
                      "source": "XLA:CPU memory_analysis, emulated devices"}), flush=True)
    tr.close()


def fits(widths: list[int], layers: int, limits_gb=(16, 80)) -> None:
  import numpy as np
  peaks = {"off": [], "on": []}
  for width in widths:
    for mode in peaks:
      tr = _trainer("transformer", mode, width, layers)
      tr.fit(2)  # The second step compiles the step's first program (it unpacks an update).
      peaks[mode].append(_peaks(tr)["step_peak"])
      tr.close()
  out = {"fits": "largest transformer d_model", "layers": layers, "measured_widths": widths,
         "measured_peaks": peaks, "method": "a W^2 + b W + c fitted to XLA:CPU peaks, solved "
                                            "(an extrapolation)"}
  for mode, ys in peaks.items():
    a, b, c = np.polyfit(np.array(widths, float), np.array(ys, float), 2)
    for gb in limits_gb:
      roots = [r.real for r in np.roots([a, b, c - gb * 1e9]) if abs(r.imag) < 1e-9 and r.real > 0]
      out[f"{mode}_{gb}GB"] = int(max(roots)) if roots else None
  print(json.dumps(out), flush=True)


def gspmd(devices: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
  import _layer_models as layer_models
  from hetjax.mesh import DEV
  from hetjax.step import within_host
  task = layer_models.decoder("scan")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (DEV,))
  block = {"x": np.zeros((2, 16), np.int32), "hetjax.mask": np.ones(2, np.float32)}
  params, state = task.init(jax.random.key(0), block)
  split = within_host.Split(params, devices)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), split.specs)
  blocks = {k: np.repeat(v[None], devices, 0) for k, v in block.items()}
  keys = jax.random.split(jax.random.key(1), devices)

  def grads(p, b, k):  # One block per device, split over DEV; XLA places every collective.
    total = lambda p: jnp.sum(jax.vmap(lambda b, k: jnp.sum(task.loss(p, state, b, k)[0]))(b, k))
    g = jax.grad(total)(p)
    return jax.lax.with_sharding_constraint(g, shardings)

  by_dev = NamedSharding(mesh, P(DEV))
  compiled = jax.jit(grads, in_shardings=(shardings, by_dev, by_dev),
                     out_shardings=shardings).lower(params, blocks, keys).compile()
  text = compiled.as_text()
  gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", text)
  batch_shaped = sum(g.startswith("f32[%d," % devices) for g in gathers)
  print(json.dumps({"gspmd": "scan", "devices": devices, "peak": within_host.peak_bytes(compiled),
                    "all_gathers": len(gathers), "of_activations": batch_shaped,
                    "note": "gathers whose leading axis is the host's blocks carry activations: "
                            "the batch was replicated, the parameters kept split",
                    "source": "XLA:CPU memory_analysis, emulated devices"}), flush=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--parts", default="structures,gspmd,transformer,resnet50,fits",
                      help="which figures, comma-separated (resnet50 takes most of the time)")
  args = parser.parse_args(argv)
  parts = args.parts.split(",")
  _setup(args.devices)
  if "structures" in parts:
    structures(args.devices)
  if "gspmd" in parts:
    gspmd(args.devices)
  if "transformer" in parts:
    measure("transformer", args.steps, args.width, args.layers)
  if "resnet50" in parts:
    measure("resnet50", args.steps)
  if "fits" in parts:
    fits([64, 128, 256], args.layers)


if __name__ == "__main__":
  sys.exit(main())
