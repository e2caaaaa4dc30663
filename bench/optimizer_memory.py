"""Per-device bytes of the optimizer under the sharded update, by optimizer and layout.

Run from the repository root (about a minute; nothing trains):

  .venv/bin/python bench/optimizer_memory.py [--model resnet50] [--devices 6]

For each optimizer the layout is the one a run would choose at start
(`hetjax.step.optimizer_layout`: read from the traced program, or probed
by running it on this CPU; `choose_s` is what that costs), and the bytes are
those of the arrays (`memory_per_device`, what `summary.json` reports):
`opt_state` is what each device keeps between steps, `transient` what the
whole layout also gathers for the length of an update (the whole gradients,
parameters and optimizer state), `unsplit` the optimizer state of one
device holding all of it. 6 devices stand for 3 hosts x 2 devices.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

from hetjax import models as zoo
from hetjax.step import TrainState, optimizer_layout, sharding
from hetjax.step.precision import initial_scale

OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw, no decay on vectors": lambda: optax.adamw(
        1e-3, weight_decay=1e-4, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p)),
    "adam, clipped": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                         optax.adam(1e-3)),
    "adafactor": lambda: optax.adafactor(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet50")
  parser.add_argument("--devices", type=int, default=6)
  args = parser.parse_args()
  task = zoo.build(args.model, kind="image", num_classes=10)
  batch = {"x": jnp.zeros((1, 32, 32, 3), jnp.float32), "y": jnp.zeros((1,), jnp.int32)}
  params, model_state = jax.eval_shape(lambda: task.init(jax.random.key(0), batch))
  mb = lambda b: round(b / 2**20, 1)
  out = {}
  for name, make in OPTIMIZERS.items():
    optimizer = make()
    opt_state = jax.eval_shape(optimizer.init, params)
    start = time.perf_counter()
    choice = optimizer_layout.choose(optimizer, params, opt_state, args.devices)
    probe_s = time.perf_counter() - start
    like = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt_state, model_state,
                      jax.eval_shape(lambda: initial_scale("fp32")))
    figure = sharding.memory_per_device(like, args.devices, optimizer, choice.layout)
    split, unsplit = figure["split"], figure["unsplit"]
    out[name] = {"layout": choice.layout, "opt_state_mb": mb(split["opt_state"]),
                 "unsplit_opt_state_mb": mb(unsplit["opt_state"]),
                 "transient_mb": mb(split.get("transient", 0)), "choose_s": round(probe_s, 1)}
    print(f"{name:28s} {choice.layout:6s} optimizer state {mb(split['opt_state']):7.1f} MB "
          f"per device (unsplit {mb(unsplit['opt_state']):7.1f}), during the update "
          f"+{mb(split.get('transient', 0)):6.1f} MB; chosen in {probe_s:.1f} s", flush=True)
  print(json.dumps({"model": args.model, "devices": args.devices, "params_mb": mb(
      sharding.tree_bytes(params)), "optimizers": out}))


if __name__ == "__main__":
  main()
