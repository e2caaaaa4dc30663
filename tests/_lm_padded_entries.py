"""examples/lm_padded.py trained by hetjax, run on every host of an emulated cluster.

The global batch is the whole data set, so every step's objective is the
token mean over all of it whatever order the sampler draws the records in:
the reference (tests/test_lm_padded.py) needs no sampler.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

RECORDS = 22          # = the global batch; blocks of 4: five whole, the last 2 real + 2 padding.
BLOCK = 4
UNEVEN = (12, 8, 2)   # 3, 2 and 1 blocks: host 2 runs the partial block.
STEPS = 5
LR = 0.5
CONFIGS = {           # name: TrainConfig fields besides the common ones.
    "3 uneven hosts, device batches 2,2,1": {"device_batch": (2, 2, 1)},
    "3 uneven hosts, sharded within each host": {"shard_within_host": "on"},
}


def example():
  """The example module (the repository root need not be on a host's path)."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  from examples import lm_padded
  return lm_padded


def train():
  """{config name: (initial parameters, parameters after STEPS)} on this host, as numpy."""
  import jax
  import optax

  import hetjax
  lm_padded = example()
  hetjax.initialize()
  info = hetjax.DatasetInfo("padded-counting", "tokens", vocab_size=lm_padded.VOCAB)
  source = hetjax.ArraySource(lm_padded.arrays(RECORDS, 0), info)
  out = {}
  for name, fields in CONFIGS.items():
    config = hetjax.TrainConfig(global_batch=RECORDS, microbatch=BLOCK, seed=0,
                                assignment=UNEVEN, **fields)
    tr = hetjax.Trainer(lm_padded.task(), optax.sgd(LR), source, config)
    initial = jax.tree.map(np.asarray, tr.params())
    tr.fit(STEPS)
    out[name] = (initial, jax.tree.map(np.asarray, tr.params()))
    tr.close()
  return out
