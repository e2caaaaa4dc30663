"""Per-device peak bytes and step time with and without sharding within a host.

Run from the repository root (a few minutes on 2 cores):

  .venv/bin/python bench/memory.py [--devices 4] [--steps 5] [--parts gspmd,transformer,fits]

Every figure of bytes is XLA:CPU's `compiled.memory_analysis()` of the
compiled local program (arguments + outputs not aliased + temporaries, per
device), on one host of `--devices` emulated CPU devices: what a GPU's
compiler would hold differs, the ratio is the point. Step times are
XLA:CPU's, on emulated devices that share the machine's cores: a gather
there is a memory copy, not a link, so they say little about a GPU.

Printed, as JSON lines:
- `model`: resnet50 (32x32 digits, --microbatch 4) and the transformer, each
  with `--shard-within-host off` and `on`: the steady local program's peak
  (`grad_peak`), the step's first program's (`first_peak`, it also unpacks
  the sharded update's result), and the median step time.
- `fits`: the largest transformer width (d_model, `LAYERS` layers, the
  tokens data) whose local program fits 16 GB and 80 GB devices, with and
  without sharding: peaks measured at small widths, fitted as
  `a W^2 + b W + c` (parameters grow as W^2, activations as W) and solved;
  an extrapolation from the same analysis, said so.
- `gspmd_vs_explicit`: one block's gradient of the transformer with its
  parameters split over the devices, written with GSPMD annotations
  (`NamedSharding` constraints, XLA places the gathers) and with explicit
  collectives in `shard_map` (`hetjax.step.within_host`): peak bytes,
  collectives and time.
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
  from hetjax.step import within_host
  local = tr.mode.local
  return {"grad_peak": max(within_host.peak_bytes(c) for c in local._grad.values()),
          "first_peak": max(within_host.peak_bytes(c) for c in local._update_then_grad.values())}


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
      p = _peaks(tr)
      peaks[mode].append(max(p.values()))
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


def gspmd_vs_explicit(width: int, layers: int, devices: int, repeats: int = 5) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from hetjax import models as zoo
  from hetjax.input import data
  from hetjax.mesh import DEV
  from hetjax.step import within_host
  from hetjax.step.optimizer_layout import join_leaf, split_leaf
  source = data.load("tokens")
  task = zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size,
                   d_model=width, num_layers=layers)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), (DEV,))
  batch = {"x": np.asarray(source.arrays["x"][:4 * devices])}
  batch["hetjax.mask"] = np.ones(4 * devices, np.float32)
  params, model_state = task.init(jax.random.key(0), {k: v[:4] for k, v in batch.items()})
  split = within_host.Split(params, devices)
  by_dev = NamedSharding(mesh, P(DEV))
  rows = jax.device_put(jax.tree.map(lambda x: split_leaf(x, devices), params), by_dev)
  batch = jax.device_put(batch, by_dev)
  rng = jax.random.key(1)

  def loss(p, b):
    return jnp.sum(task.loss(p, model_state, b, rng)[0])

  def annotated(rows, b):  # GSPMD: constraints only; XLA inserts and places the collectives.
    def f(rows):
      whole = jax.tree.map(lambda x, like: join_leaf(jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, P())), like.shape), rows, split.like)
      per_device = b["x"].reshape(devices, -1, b["x"].shape[-1])
      masks = b["hetjax.mask"].reshape(devices, -1)
      return jnp.sum(jax.vmap(lambda x, m: loss(whole, {"x": x, "hetjax.mask": m}))(
          per_device, masks))
    g = jax.grad(f)(rows)
    return jax.lax.with_sharding_constraint(g, by_dev)

  def explicit(rows, b):  # shard_map: one all_gather per leaf, its transpose a reduce-scatter.
    gathered = split.gathering(task)
    return jax.grad(lambda r: jnp.sum(gathered.loss(r, model_state, b, rng)[0]))(rows)

  programs = {
      "gspmd": jax.jit(annotated, out_shardings=by_dev),
      "explicit": jax.jit(jax.shard_map(explicit, mesh=mesh, in_specs=(P(DEV), P(DEV)),
                                        out_specs=P(DEV))),
  }
  for name, program in programs.items():
    compiled = program.lower(rows, batch).compile()
    text = compiled.as_text()
    collectives = {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))
                   for op in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                              "collective-permute")}
    jax.block_until_ready(compiled(rows, batch))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(rows, batch))
      times.append(time.perf_counter() - start)
    print(json.dumps({"gspmd_vs_explicit": name, "width": width, "layers": layers,
                      "peak": within_host.peak_bytes(compiled),
                      "collectives": {k: v for k, v in collectives.items() if v},
                      "step_s": round(float(np.median(times)), 4),
                      "source": "XLA:CPU memory_analysis, emulated devices"}), flush=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--parts", default="gspmd,transformer,resnet50,fits",
                      help="which figures, comma-separated (resnet50 takes most of the time)")
  args = parser.parse_args(argv)
  parts = args.parts.split(",")
  _setup(args.devices)
  if "gspmd" in parts:
    gspmd_vs_explicit(args.width, args.layers, args.devices)
  if "transformer" in parts:
    measure("transformer", args.steps, args.width, args.layers)
  if "resnet50" in parts:
    measure("resnet50", args.steps)
  if "fits" in parts:
    fits([64, 128, 256], args.layers)


if __name__ == "__main__":
  sys.exit(main())
