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


def mixed_compilers(steps: int, check_every: int, reduction: str = "device"):
  """(the step an agreement check failed at or None, final params) on this host."""
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
  optimizer = optimizers.make("adam", 0.003, clip_norm=1.0)
  config = trainer.TrainConfig(global_batch=32, microbatch=8, seed=0, reduction=reduction,
                               check_every=check_every)
  tr = trainer.Trainer(task, optimizer, source, config)
  failed = None
  try:
    tr.fit(steps)
  except agreement.HostsDisagree:
    failed = tr.step
  params = tr.params()
  tr.close()
  return failed, params
