"""Entries for tests/test_blocks.py: dropout masks and weighted losses on emulated clusters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax import trainer
from hetjax.input import data

RECORDS, FEATURES, BATCH, BLOCK, SEED = 64, 32, 62, 4, 7


def mask_task():
  """Each example's gradient is its dropout mask: one SGD step writes it into `p[i]`."""
  def init(rng, batch):
    return {"p": jnp.zeros((RECORDS, FEATURES))}

  def loss(params, batch, rng):
    keep = jax.random.bernoulli(rng, 0.5, (len(batch["i"]), FEATURES)).astype(jnp.float32)
    return jnp.sum(keep * params["p"][batch["i"]], axis=1), {}

  return hetjax.from_functions(init, loss)


def dropout_masks(assignment):
  """The mask each global example drew in step 0, read back from the parameters."""
  hetjax.initialize()
  source = data.ArraySource({"i": np.arange(RECORDS, dtype=np.int32)})
  config = trainer.TrainConfig(global_batch=BATCH, microbatch=BLOCK, seed=SEED,
                               assignment=assignment)
  tr = trainer.Trainer(mask_task(), optax.sgd(-float(BATCH)), source, config)
  tr.fit(1)
  return tr.params()["p"], tr.sampler.indices(0), tr.history.shares[0]


def weighted(assignment):
  """A token-count-weighted loss: the update must be sum(token losses) / sum(tokens)."""
  hetjax.initialize()
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 9, RECORDS)
  tokens = (np.arange(8)[None] < lengths[:, None]) * rng.normal(size=(RECORDS, 8))
  source = data.ArraySource({"t": tokens.astype(np.float32),
                             "n": lengths.astype(np.float32)})

  def loss(params, batch, rng):
    per_token = (batch["t"] - params["w"]) ** 2 * (batch["t"] != 0)
    return hetjax.Weighted(per_token.sum(axis=1), batch["n"]), {}

  task = hetjax.from_functions(lambda rng, b: {"w": jnp.zeros(())}, loss)
  config = trainer.TrainConfig(global_batch=BATCH, microbatch=BLOCK, seed=SEED,
                               assignment=assignment)
  tr = trainer.Trainer(task, optax.sgd(0.5), source, config)
  tr.fit(1)
  idx = tr.sampler.indices(0)
  t, n = tokens[idx], lengths[idx]
  # d/dw of sum((t - w)^2 over real tokens) at w = 0, over the token count.
  expected = -0.5 * (-2.0 * t.sum()) / n.sum()
  return float(tr.params()["w"]), float(expected)
