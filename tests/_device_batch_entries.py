"""Entry points of the device-batch tests (issue 27): one cluster start serves them all.

`cluster` trains four models (ResNet-18 with BatchNorm, the transformer
with dropout, a linen and an NNX module with BatchNorm and Dropout; all SGD,
so a normaliser off by anything shows) on a fixed uneven split and on the
split a static balancer solves from recorded timings, every host with its
own device batch; then 200 dynamic-balancer steps whose shares move, counting
compilations after the start.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import hetjax
from _exact_entries import LinenBatchNormDropout, _classification, nnx_model
from hetjax import blocks, trainer
from hetjax import models as zoo
from hetjax.input import data

MODELS = ("resnet18", "transformer", "linen", "nnx")
BLOCK = 4
GLOBAL_BATCH = 74              # 19 blocks, the last half real.
UNEVEN = (44, 20, 10)          # 11, 5 and 3 blocks: on 2 devices, 6 (4 + 2), 3 (2 + 1), 2 rounds.
DEVICE_BATCHES = (4, 2, 1)
SEED = 5
FIXED_STEPS, STEPS = 3, 6     # UNEVEN for 3 steps, then the balancer's (see `FixedThenStatic`).
SPEEDS = (1.0, 0.5, 0.25)      # Recorded relative device speeds, by host.
SAMPLE_S = 1e-3                # Recorded seconds per sample on the fastest device.
LR = {"resnet18": 0.02, "transformer": 0.05, "linen": 0.1, "nnx": 0.1}


def build(model: str):
  """(source, task, optimizer) of one model; the test's oracle uses the same."""
  if model == "resnet18":
    # 16x16 (the digits upscaled): on 8x8 inputs the last stage is 1x1 and
    # BatchNorm over a block's few values per channel turns rounding chaotic.
    digits = data.load("digits")
    upscale = lambda x: np.repeat(np.repeat(x, 2, axis=1), 2, axis=2)
    source = data.ArraySource({"x": upscale(digits.arrays["x"]), "y": digits.arrays["y"]},
                              digits.info)
    task = zoo.build("resnet18", kind="image", num_classes=10, width=4)
  elif model == "transformer":
    source = data.load("tokens")
    task = zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size,
                     num_layers=1, d_model=16, dropout=0.1)
  elif model == "linen":
    source, task = data.load("digits"), hetjax.from_linen(LinenBatchNormDropout(), _classification)
  elif model == "nnx":
    source, task = data.load("digits"), hetjax.from_nnx(nnx_model(), _classification)
  else:
    raise ValueError(model)
  return source, task, optax.sgd(LR[model])


def recorded(speeds):
  """A pace hook: `samples x SAMPLE_S / speed` of this host, never the clock.

  `speeds(step)` gives every host's speed at a step: the balancer's
  decisions are then a function of the shares alone, the same in every run.
  """
  host = jax.process_index()
  return lambda compute_s, step, samples=0: samples * SAMPLE_S / speeds(step)[host]


class FixedThenStatic:
  """UNEVEN for the first `FIXED_STEPS` steps, then a static balancer's split.

  One trainer per model meets both splits. The static policy sees every
  step's recorded timings from the start; its solved split (whole blocks,
  priced on each host's ladder) runs from step 6: step 1's timings travel
  in step 3's rows, fetched after step 4 is dispatched, and the shortest
  warm-up is 2 steps.
  """

  def __init__(self, devices):
    self.inner = blocks.make_block_balancer("equal", GLOBAL_BATCH, BLOCK, devices, mode="static",
                                            warmup_steps=2, device_batches=DEVICE_BATCHES)
    self.name = "fixed-then-static"

  def shares(self, step):
    return UNEVEN if step < FIXED_STEPS else self.inner.shares(step)

  def observe(self, step, shares, compute_s):
    self.inner.observe(step, shares, compute_s)

  @property
  def decisions(self):
    return self.inner.decisions


def _local_state(tr):
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tr.state.model_state)


def models_on_two_splits(models=MODELS):
  """{model: {steps: (params, model state)}, "shares": ...} after the fixed and the balanced
  splits."""
  out = {}
  devices = [jax.local_device_count()] * jax.process_count()
  for model in models:
    source, task, optimizer = build(model)
    config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=BLOCK, seed=SEED,
                                 device_batch=DEVICE_BATCHES, check_every=0)
    tr = trainer.Trainer(task, optimizer, source, config, balancer=FixedThenStatic(devices),
                         pace=recorded(lambda step: SPEEDS))
    out[model] = {}
    for steps in (FIXED_STEPS, STEPS):
      tr.fit(until=steps)
      out[model][steps] = (tr.params(), _local_state(tr))
    out[model]["shares"] = list(tr.history.shares)
    tr.close()
  return out


def dynamic_compiles(steps: int = 200, warm: int = 2):
  """Compilations after `warm` steps while a dynamic balancer moves shares every few steps."""
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  orders = [(1.0, 0.5, 0.25), (0.25, 1.0, 0.5), (0.5, 0.25, 1.0)]
  speeds = lambda step: orders[(step // 25) % len(orders)]
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(8,))
  config = trainer.TrainConfig(global_batch=96, microbatch=BLOCK, seed=SEED, balancer="dynamic",
                               device_batch=DEVICE_BATCHES, check_every=0)
  tr = trainer.Trainer(task, optax.sgd(0.1), source, config, pace=recorded(speeds))
  tr.fit(warm)
  before = len(compiles)
  summary = tr.fit(steps - warm)
  shares = list(tr.history.shares)
  tr.close()
  return {"after_start": len(compiles) - before, "shares": shares,
          "device_batches": summary.get("device_batches")}


def cluster():
  """Everything the cluster test asserts, from one cluster start."""
  hetjax.initialize()
  return {"splits": models_on_two_splits(), "dynamic": dynamic_compiles()}
