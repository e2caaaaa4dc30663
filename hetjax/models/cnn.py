"""A small convolutional classifier for 8x8 digits and other small images."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax

from .preprocess import as_input


class CNN(nn.Module):
  """3x3 conv + ReLU layers, one 2x2 max-pool, then a ReLU dense layer.

  Pooling once, at the end, keeps the spatial detail an 8x8 digit has (two
  pools would leave 2x2); with adam (lr 1e-3, batch 64) it reaches ~99% test
  accuracy on sklearn digits in 300 steps, in a few seconds on CPU.

  Attributes:
    num_classes: size of the output layer.
    features: channels of each conv layer.
    hidden: width of the dense layer before the head.
    dropout: rate of dropout before the head in training.
    dtype: computation dtype (parameters stay float32); None follows `--precision`.
  """

  num_classes: int
  features: Sequence[int] = (16, 32)
  hidden: int = 128
  dropout: float = 0.0
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = as_input(x, self.dtype)
    for features in self.features:
      x = nn.relu(nn.Conv(features, (3, 3), dtype=self.dtype)(x))
    # Pool only along sides that have something to pool, so 1-pixel inputs work.
    window = (min(2, x.shape[1]), min(2, x.shape[2]))
    x = nn.max_pool(x, window, strides=window)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype)(x))
    x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)
