"""Entries for tests/test_within_host.py, run on every host of an emulated cluster.

The 3x2 cluster that shards on one host only is the exactness matrix's
(`_exact_entries.SHARD_WITHIN_HOST`). `train_saving`: an mlp saving and
resuming under a sharding choice. `peaks`: a device's step peak bytes
(XLA's memory analysis of every program of a step) of a decoder, with and
without sharding, on this host's devices. `scanned`: a stacked decoder
trained with device batches and sharding.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data
from hetjax.step import within_host_choice

import _layer_models as layer_models

GLOBAL_BATCH = 30   # Not a multiple of the block: the last block is partial.
BLOCK = 4


def build_mlp():
  """(source, task, optimizer): the digits mlp with sgd."""
  return (data.load("digits"), zoo.build("mlp", kind="image", num_classes=10, hidden=(32,)),
          optax.sgd(0.1))


def peaks(structure: str, device_batch: int = 1):
  """{'off' | 'on': a device's step peak bytes (`LocalProgram.peak_bytes`)} of the decoder
  of `structure` (tests/_layer_models.py) on this host, and what 'auto' decides against an
  emulated device of 1 MB and of 1 TB."""
  out = {}
  for mode in ("off", "on"):
    source, task = data.load("tokens"), layer_models.decoder(structure)
    config = trainer.TrainConfig(global_batch=32, microbatch=2, shard_within_host=mode,
                                 device_batch=device_batch)
    tr = trainer.Trainer(task, optax.sgd(0.1), source, config)
    tr.fit(2)  # The second step unpacks the sharded update's result.
    out[mode] = tr.mode.local.peak_bytes()
    if mode == "off":
      state, example = tr.state, {k: v[:1] for k, v in source.arrays.items()}
      for gb in (1e-3, 1e3):
        auto = trainer.TrainConfig(global_batch=16, microbatch=4, shard_within_host="auto",
                                   device_memory=gb)
        out[f"auto {gb:g} GB"] = within_host_choice.for_host(
            auto, task, state.params, state.model_state, example, tr.mode.meshes)
    tr.close()
  return out


def scanned(shard_within_host: str, device_batch, steps: int = 3, structure: str = "scan"):
  """The decoder stacked as `structure` (tests/_layer_models.py; 'scan': `nn.scan(nn.remat(
  Block))`, tied embeddings) trained `steps` steps with sgd: (final parameters as numpy, sharded on this host?, the summary's step peaks of
  every host, this host's `memory_per_device` and `Trainer.step_peak`)."""
  if jax.process_count() > 1:
    hetjax.initialize()
  config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=2, seed=3,
                               shard_within_host=shard_within_host, device_batch=device_batch)
  tr = trainer.Trainer(layer_models.decoder(structure, width=64, layers=3), optax.sgd(0.1),
                       data.load("tokens"), config)
  summary = tr.fit(steps)
  out = (jax.tree.map(np.asarray, tr.params()), tr.mode.local.within is not None,
         summary["step_peak_per_host"], tr.mode.memory_per_device(), tr.step_peak())
  tr.close()
  return out


def train_saving(directory: str, shard_within_host: str, until: int):
  """The mlp trained to step `until` with a checkpoint every 2 steps in `directory`
  (resuming from it if it holds one): (resumed from, final parameters as numpy)."""
  from hetjax import checkpoint  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    hetjax.initialize()
  source, task, optimizer = build_mlp()
  config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=BLOCK, seed=3,
                               shard_within_host=shard_within_host)
  tr = trainer.Trainer(task, optimizer, source, config,
                       checkpoint=checkpoint.CheckpointConfig(directory, every=2))
  tr.fit(until=until)
  out = (tr.resumed_from, jax.tree.map(np.asarray, tr.params()), tr.mode.local.within is not None)
  tr.close()
  return out
