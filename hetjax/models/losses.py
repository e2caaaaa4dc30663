"""Per-example losses and metrics shared by every model: never reduced over the batch
(hetjax sums over the real examples of every host), each of shape `[b]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hetjax.task import Weighted
from hetjax.types import Batch

Metrics = dict[str, jax.Array]


def classification(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
  """`(losses [b], {"accuracy": [b]})` of `logits [b, classes]` vs `batch["y"]`, in float32
  even for a bfloat16 model."""
  logits = logits.astype(jnp.float32)
  labels = batch["y"].astype(jnp.int32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return losses, {"accuracy": correct}


TOKEN_MASK = "x_mask"  # The batch key of a token padding mask, [b, T]: 1 real, 0 padding.


def next_token(logits: jax.Array, batch: Batch) -> tuple[Weighted, Metrics]:
  """Next-token cross-entropy of `logits [b, T, V]` vs `batch["x"] [b, T]`, weighted by tokens.

  Position `t` predicts token `t + 1`, a target that counts when both are real
  in `batch["x_mask"]` (absent: all real). Summed losses and token counts per
  sequence make the update the mean over the global batch's real tokens on
  any split, which a per-sequence mean is not. Returns `(Weighted(values [b], weights [b]),
  {"accuracy": [b] correct tokens})`.
  """
  tokens = batch["x"].astype(jnp.int32)
  if tokens.shape[1] < 2:
    raise ValueError(f"Next-token loss needs sequences of length >= 2; got {tokens.shape[1]}.")
  logits = logits[:, :-1].astype(jnp.float32)
  targets = tokens[:, 1:]
  real = batch.get(TOKEN_MASK)
  real = (jnp.ones(targets.shape, jnp.float32) if real is None else
          (real[:, :-1] * real[:, 1:]).astype(jnp.float32))
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * real
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * real
  return Weighted(losses.sum(-1), real.sum(-1)), {"accuracy": correct.sum(-1)}
