"""Entries for the sharded-update tests (`tests/test_sharded_update.py`), run on every host.

`mixed_compilers`: a tiny mlp trained with adam and a clipped global norm
while the hosts' compilers differ (the test gives host 1 other XLA flags);
each host returns whether every agreement check passed and its final
parameters.
"""

from __future__ import annotations

import numpy as np

import hetjax
# The models, batch, blocks and split of tests/_exact_entries.py, whose 3x2 run
# saves the checkpoints that `train_and_save` resumes.
from _exact_entries import BLOCK, GLOBAL_BATCH, SEED, UNEVEN, build, optimizer_memory  # noqa: F401
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


# ---- a checkpoint of the exactness matrix's 3 uneven hosts x 2 devices, resumed on 2 x 1 ----

MODELS = ("resnet18", "transformer")  # BatchNorm (sgd); dropout (adam).


def train_and_save(until: int, reduction: str, assignment, folder: str, resume: bool):
  """Every model trained to step `until` with checkpoints in `folder/<model>`.

  Returns, per model, what `_exact_entries.matrix` does, with the step it
  resumed from in place of the shares: (params, model state, resumed from,
  (optimizer bytes per device, unsplit, the summary's memory figure)).
  """
  import jax
  from hetjax import checkpoint
  hetjax.initialize()
  out = {}
  for model in MODELS:
    source, task, optimizer = build(model)
    config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=BLOCK, seed=SEED,
                                 reduction=reduction, assignment=assignment)
    tr = trainer.Trainer(task, optimizer, source, config, checkpoint=checkpoint.CheckpointConfig(
        f"{folder}/{model}", every=until, resume=resume))
    summary = tr.fit(until=until)
    out[model] = (tr.params(), jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                            tr.local_state.model_state),
                  tr.resumed_from, optimizer_memory(tr, summary))
    tr.close()
  return out
