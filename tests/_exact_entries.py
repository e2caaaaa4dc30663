"""The exactness matrix (DESIGN invariant 2), runnable on any emulated cluster.

Four models that a split could change if blocks were not the unit: ResNet-10
(the Flax examples' ResNet, one block per stage; BatchNorm; sgd), the
transformer with dropout (adam), an NNX model and a linen model (using
`deterministic`) each with BatchNorm and Dropout. Each is
trained `STEPS` steps with the reduction backends asked for (both by
default); hosts return their final parameters, model state, the shares
every step used, the optimizer state's memory and the device batches.

`clusters` trains every model once on 3x2, in one cluster start: the fixed
uneven split for `FIXED_STEPS` steps, then the split a static balancer
solves from recorded timings, every host with its own device batch
(`DEVICE_BATCHES`), host 2 sharding its state over its own devices
(`SHARD_WITHIN_HOST`). It saves the `SAVED` models' runs for
tests/test_sharded_update.py, which resumes them on 2 hosts x 1 device: one
start of 3 hosts serves four test files (tests/test_device_batch.py checks
the device batches on these runs, tests/test_within_host.py the sharding).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import blocks, checkpoint, trainer
from hetjax.step import sharding
from hetjax.input import data

STEPS = 6
FIXED_STEPS = 3     # On 3x2: UNEVEN for these steps, then the balancer's split (`FixedThenStatic`).
GLOBAL_BATCH = 62   # Not a multiple of the block: the last block is partial.
BLOCK = 4           # --microbatch: positions per block.
# 9, 5 and 2 blocks: on 2 devices with device batches (4, 2, 1), host 0 runs
# 5 rounds as programs of 4 + 1 and host 1 3 rounds as 2 + 1, each filling
# half its last round; host 2 runs 1 round, ending with the partial block.
UNEVEN = (36, 20, 6)
DEVICE_BATCHES = (4, 2, 1)  # Blocks per device in each host's largest program, on 3x2.
SEED = 3
# ResNet-10: ResNet-18's blocks, one per stage instead of two. Every kind of
# layer ResNet-18 has (strided and projection shortcuts, BatchNorm after every
# convolution) for about 65 % of its CPU time, most of it compiling (a 1x1
# trainer's 6 steps: 5.5 against 8.7 CPU-s; the four files: 306 against 465).
RESNET_STAGES = (1, 1, 1, 1)
SHARD_WITHIN_HOST = "off,off,on"  # On 3x2: host 2 shards within itself, the others hold it whole.
SPEEDS = (1.0, 0.5, 0.25)  # The balanced split's recorded device speeds, by host.
SAMPLE_S = 1e-3            # Its recorded seconds per sample on the fastest device.


def _classification(logits, batch):
  labels = batch["y"].astype(jnp.int32)
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels), {
      "accuracy": (jnp.argmax(logits, -1) == labels).astype(jnp.float32)}


class LinenBatchNormDropout(nn.Module):
  """What the Flax examples write: `deterministic`, BatchNorm with a mask, Dropout.

  A convolution feeds BatchNorm, so each channel's statistics cover a block's
  4 x 64 pixels: BatchNorm over a few values alone makes training so
  sensitive that no two float reduction orders agree after a few steps.
  """

  @nn.compact
  def __call__(self, x, deterministic: bool = True, mask=None):
    # No bias before BatchNorm (it cancels, so its gradient is rounding
    # noise, which Adam would turn into full-size steps), as ResNets do.
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=deterministic, momentum=0.8)(
        x, mask=None if mask is None else mask[:, None, None, None] > 0)
    x = nn.Dropout(0.3, deterministic=deterministic)(nn.relu(x))
    self.sow("intermediates", "hidden", x)  # Must not be mistaken for model state.
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


def nnx_model():
  from flax import nnx

  class NnxBatchNormDropout(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(8, momentum=0.8, rngs=rngs)
      self.drop = nnx.Dropout(0.3, rngs=rngs)
      self.head = nnx.Linear(8 * 64, 10, rngs=rngs)

    def __call__(self, x, mask=None):
      x = self.bn(self.conv(x), mask=None if mask is None else mask[:, None, None, None] > 0)
      x = self.drop(jax.nn.relu(x))
      return self.head(x.reshape(x.shape[0], -1))

  return NnxBatchNormDropout(nnx.Rngs(params=0, dropout=1))


def build(model: str):
  """(source, task, optimizer) of one matrix entry; the oracle uses the same."""
  if model == "resnet10":
    # 32x32 (the digits upscaled): on 8x8 inputs the last stage is 1x1, and
    # BatchNorm over a block's 4 values per channel makes training chaotic
    # (a 1e-6 change of the init moved the parameters by 200 % in 6 steps),
    # so no two float reduction orders could agree.
    digits = data.load("digits")
    upscale = lambda x: np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)
    source = data.ArraySource({"x": upscale(digits.arrays["x"]), "y": digits.arrays["y"]},
                              digits.info)
    task = zoo.build("resnet18", kind="image", num_classes=10, width=4,
                     stage_sizes=RESNET_STAGES)
    return source, task, optax.sgd(0.02)
  if model == "transformer":
    source = data.load("tokens")
    task = zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size,
                               num_layers=1, d_model=32, dropout=0.1)
    return source, task, optax.adam(3e-3)
  if model == "linen":
    return data.load("digits"), hetjax.from_linen(LinenBatchNormDropout(), _classification,
                                              mask_arg="mask"), \
        optax.sgd(0.1)
  if model == "nnx":
    return data.load("digits"), hetjax.from_nnx(nnx_model(), _classification, mask_arg="mask"), \
        optax.adam(3e-3)
  raise ValueError(model)


MODELS = ("resnet10", "transformer", "linen", "nnx")
# Each model's reduction backend on 3x2 (both on 1x1): a backend only sums
# one float32 row per device whatever the model and split, so each meets two
# models on both splits, with a quarter of the trainers of every model on
# every backend and split (compiling each host's ladder of programs is most
# of a trainer's cost). The saved models take the device backend: on it the
# sharded update splits adam's state over all 6 devices.
CLUSTER_REDUCTION = {"resnet10": "device", "transformer": "device", "linen": "host", "nnx": "host"}
# On 1x1 each model meets the other backend: every model sees both, each backend all four.
ONE_DEVICE_REDUCTION = {m: "host" if r == "device" else "device"
                        for m, r in CLUSTER_REDUCTION.items()}
SAVED = ("resnet10", "transformer")  # Checkpointed at STEPS by `clusters` (see the docstring).


def _static_balancer(tr_devices, device_batches=None):
  # The static policy with the shortest warm-up, so that the solved split
  # runs within the test's few steps: step 1's timings reach the balancer
  # at step 5 (they travel in step 3's rows, fetched after step 4 is
  # dispatched), which runs the solved split (whole blocks, priced on each
  # host's ladder of programs).
  return blocks.make_block_balancer("equal", GLOBAL_BATCH, BLOCK, tr_devices, mode="static",
                                    warmup_steps=2, device_batches=device_batches)


class FixedThenStatic:
  """UNEVEN for the first `FIXED_STEPS` steps, then a static balancer's split.

  One trainer per model meets both splits. The static policy sees every
  step's recorded timings from the start; its solved split runs at the last
  step (see `_static_balancer`).
  """

  name = "fixed-then-static"

  def __init__(self, inner):
    self.inner = inner

  def shares(self, step):
    return UNEVEN if step < FIXED_STEPS else self.inner.shares(step)

  def observe(self, step, shares, compute_s):
    self.inner.observe(step, shares, compute_s)

  @property
  def decisions(self):
    return self.inner.decisions


def recorded_timings(compute_s: float, step: int, samples: int = 0) -> float:
  """The pace hook of the balanced split: this host's compute time, as recorded, not measured.

  `samples x SAMPLE_S / speed`, never the clock: the split the balancer
  solves from it is the same in every run, whatever the machine's load
  (measured compute on a shared machine moved it from run to run).
  """
  del compute_s, step
  return samples * SAMPLE_S / SPEEDS[jax.process_index()]


class Run(NamedTuple):
  """One trainer's end on this host, as `matrix` returns it."""
  params: Any
  model_state: Any
  shares: list                 # The split of every step.
  memory: tuple                # `optimizer_memory`.
  device_batches: list         # The summary's, one per host.
  sharded_within_host: bool


def matrix(layout: str, models=MODELS, reductions=("device", "host"),
           global_batch: int = GLOBAL_BATCH, save_to: str | None = None,
           device_batches: tuple[int, ...] | None = None,
           plan: dict[str, str] | None = None, shard_within_host: str = "off"):
  """Every (model, reduction) on this cluster; `layout` is 'equal' or 'uneven-then-static'.
  `plan` ({model: reduction}) runs those pairs instead of the product.

  Returns {(model, reduction): `Run`}; with `save_to`, the `SAVED` models write their
  step-`STEPS` checkpoint to `save_to/<model>`. `device_batches`: one per
  host (default: one block per device everywhere).
  """
  hetjax.initialize()
  out = {}
  pairs = plan.items() if plan else [(m, r) for m in models for r in reductions]
  for model, reduction in pairs:
    source, task, optimizer = build(model)
    config = trainer.TrainConfig(
        global_batch=global_batch, microbatch=BLOCK, seed=SEED, reduction=reduction,
        device_batch=device_batches or 1, shard_within_host=shard_within_host)
    custom, pace = None, None
    if layout == "uneven-then-static":
      custom = FixedThenStatic(_static_balancer(
          [jax.local_device_count()] * jax.process_count(), device_batches))
      pace = recorded_timings
    saving = None
    if save_to is not None and model in SAVED:
      saving = checkpoint.CheckpointConfig(f"{save_to}/{model}", every=STEPS)
    tr = trainer.Trainer(task, optimizer, source, config, balancer=custom, pace=pace,
                         checkpoint=saving)
    summary = tr.fit(STEPS)
    state = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tr.state.model_state)
    out[(model, reduction)] = Run(tr.params(), state, list(tr.history.shares),
                                  optimizer_memory(tr, summary), summary["device_batches"],
                                  tr.mode.local.within is not None)
    tr.close()
  return out


def optimizer_memory(tr: trainer.Trainer, summary: dict) -> tuple:
  """(bytes of optimizer state one device holds, its unsplit bytes, the summary's figure)."""
  state = tr.mode.local_state
  held = tr.mode.replica.shards.opt_state if tr.mode.sharded is not None else state.opt_state
  per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(held))
  return per_device, sharding.tree_bytes(state.opt_state), summary["memory_per_device"]


def clusters(save_to: str):
  """Every model on its 3x2 backend, the uneven then the balanced split, with device batches
  `DEVICE_BATCHES` and `SHARD_WITHIN_HOST`: {(model, reduction): ...} as `matrix` gives."""
  out = {}
  for model in MODELS:
    out.update(matrix("uneven-then-static", (model,), (CLUSTER_REDUCTION[model],),
                      save_to=save_to, device_batches=DEVICE_BATCHES,
                      shard_within_host=SHARD_WITHIN_HOST))
  return out
