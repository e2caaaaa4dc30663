"""Entries for the sharded-update tests (`tests/test_sharded_update.py`), run on every host.

`mixed_compilers`: a tiny mlp trained with adam and a clipped global norm
while the hosts' compilers differ (the test gives host 1 other XLA flags);
each host returns whether every agreement check passed and its final
parameters.
"""

from __future__ import annotations

import numpy as np

import hetjax
from hetjax import models as zoo
from hetjax import optimizers, trainer
from hetjax.input import data
from hetjax.training import agreement


BACKENDS = ("device", "host")


def mixed_compilers(steps: int, check_every: int, backends=BACKENDS):
  """Per backend: (the step an agreement check failed at or None, final params) on this host."""
  hetjax.initialize()
  source = data.load("digits")
  out = []
  for reduction in backends:
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
    optimizer = optimizers.make("adam", 0.003, clip_norm=1.0)
    config = trainer.TrainConfig(global_batch=32, microbatch=16, seed=0, reduction=reduction,
                                 check_every=check_every)
    tr = trainer.Trainer(task, optimizer, source, config)
    failed = None
    try:
      tr.fit(steps)
    except agreement.HostsDisagree:
      failed = tr.step
    out.append((failed, tr.params()))
    tr.close()
  return out


ROUND_MODES = (("hybrid", "device"), ("elastic", "host"))


def mixed_compilers_all(steps: int, check_every: int, rounds: int):
  """`mixed_compilers` on both backends, then each rounds mode's centre after `rounds` rounds."""
  from hetjax.modes import RoundsConfig
  from hetjax.modes.rounds_trainer import RoundsTrainer
  out = mixed_compilers(steps, check_every)
  source = data.load("digits")
  for mode, reduction in ROUND_MODES:
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
    config = trainer.TrainConfig(global_batch=32, microbatch=16, seed=0, reduction=reduction)
    tr = RoundsTrainer(task, optimizers.make("adam", 0.003, clip_norm=1.0), source, config,
                       RoundsConfig(mode=mode, local_steps=(2, 2)))
    tr.fit(rounds)
    out.append((None, tr.params()))
    tr.close()
  return out


# ---- 1 x 1 against 3 uneven hosts x 2 devices, and a checkpoint resumed on 2 x 1 ----

GLOBAL_BATCH = 62    # Not a multiple of the block: the last block is partial.
BLOCK = 4            # --microbatch: positions per block.
UNEVEN = (4, 24, 34)  # Host 0 fills half a device round; host 2 ends with the partial block.
SEED = 3
MODELS = ("resnet18", "transformer")


def build(model: str):
  """(source, task, optimizer) of one model; the test's oracle uses the same."""
  import optax
  if model == "resnet18":  # BatchNorm; 32x32 digits, 4 channels wide (see _exact_entries).
    digits = data.load("digits")
    upscale = lambda x: np.repeat(np.repeat(x, 4, axis=1), 4, axis=2)
    source = data.ArraySource({"x": upscale(digits.arrays["x"]), "y": digits.arrays["y"]},
                              digits.info)
    return source, zoo.build("resnet18", kind="image", num_classes=10, width=4), optax.sgd(0.02)
  if model == "transformer":  # Dropout; adam.
    source = data.load("tokens")
    task = zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size,
                     num_layers=1, d_model=32, dropout=0.1)
    return source, task, optax.adam(3e-3)
  raise ValueError(model)


def train_and_save(until: int, reduction: str, assignment, folder: str, resume: bool):
  """Every model trained to step `until` with checkpoints in `folder/<model>`.

  Returns, per model: (params, model state, the step it resumed from, the
  per-device bytes of the optimizer state it holds and unsplit, the
  summary's memory figure).
  """
  import jax
  from hetjax import checkpoint, sharding
  hetjax.initialize()
  out = {}
  for model in MODELS:
    source, task, optimizer = build(model)
    config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=BLOCK, seed=SEED,
                                 reduction=reduction, assignment=assignment)
    tr = trainer.Trainer(task, optimizer, source, config, checkpoint=checkpoint.CheckpointConfig(
        f"{folder}/{model}", every=until, resume=resume))
    summary = tr.fit(until=until)
    state = tr.local_state
    held = tr._shards.opt_state if tr.sharded is not None else state.opt_state
    per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes
                                  for x in jax.tree.leaves(tree))
    out[model] = (tr.params(), jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                            state.model_state),
                  tr.resumed_from, (per_device(held), sharding.tree_bytes(state.opt_state)),
                  summary["memory_per_device"])
    tr.close()
  return out
