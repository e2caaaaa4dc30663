"""Per-example losses and metrics shared by every model.

hetjax sums per-example values over the real examples of every host, so these
helpers never reduce over the batch: each returns arrays of shape `[b]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


def classification(logits: jax.Array,
                   batch: Batch) -> tuple[jax.Array, Metrics]:
  """Cross-entropy and 0/1 accuracy of `logits [b, classes]` vs `batch["y"]`.

  Returns:
    `(losses [b], {"accuracy": [b]})`, both float32.
  """
  # Models computing in bfloat16 still get float32 losses.
  logits = logits.astype(jnp.float32)
  labels = batch["y"].astype(jnp.int32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return losses, {"accuracy": correct}


def next_token(logits: jax.Array, batch: Batch) -> tuple[jax.Array, Metrics]:
  """Mean next-token cross-entropy of `logits [b, T, V]` vs `batch["x"] [b, T]`.

  Position `t` of the logits predicts token `t + 1`, so the last position has
  no target and is dropped; each example averages over its `T - 1` targets.

  Returns:
    `(losses [b], {"accuracy": [b]})`: accuracy is the fraction of correct
    next tokens in each example.
  """
  tokens = batch["x"].astype(jnp.int32)
  if tokens.shape[1] < 2:
    raise ValueError(
        "Next-token loss needs sequences of length >= 2; "
        f"got {tokens.shape[1]}.")
  logits = logits[:, :-1].astype(jnp.float32)
  targets = tokens[:, 1:]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return losses.mean(axis=-1), {"accuracy": correct.mean(axis=-1)}
