"""A multilayer perceptron: the cheapest image classifier, for smoke runs."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax

from .preprocess import as_input


class MLP(nn.Module):
  """Flattens each image and applies ReLU hidden layers, then a linear head.

  Attributes:
    num_classes: size of the output layer.
    hidden: width of each hidden layer.
    dropout: rate of dropout after each hidden layer in training.
    dtype: computation dtype (parameters stay float32); None follows `--precision`.
  """

  num_classes: int
  hidden: Sequence[int] = (128, 128)
  dropout: float = 0.0
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    x = as_input(x.reshape((x.shape[0], -1)), self.dtype)
    for width in self.hidden:
      x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
      x = nn.Dropout(self.dropout, deterministic=not train)(x)
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)
