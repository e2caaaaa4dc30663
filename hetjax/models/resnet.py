"""ResNet-18 and ResNet-50 whose BatchNorm statistics ignore padded examples.

hetjax pads batches to fixed shapes and marks the padding (`mask`); padding in
the statistics would shift real examples' activations and the running averages.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from .preprocess import as_input

_STATS = ("mean", "var")


class MaskedBatchNorm(nn.BatchNorm):
  """`nn.BatchNorm` whose masked statistics stay finite with no real example.

  For an all-padding micro-batch Flax would divide by zero real examples and
  write NaN into the running averages; this layer then normalizes with the
  padding's statistics (finite) and leaves the running averages as they were.

  Its variance is the stable `E[(x - E[x])^2]`, not Flax's `E[x^2] - E[x]^2`,
  whose cancellation amplifies the rounding of a device batch's kernels:
  ResNet-18's first update on 3x2 with device batches 4, 2, 1 moved 8.7e-4
  (relative) with Flax's, 4.1e-6 with this (bench/device_batch_exactness.py).
  """

  use_fast_variance: bool = False

  def __call__(self, x: jax.Array, use_running_average: bool | None = None,
               *, mask: jax.Array | None = None) -> jax.Array:
    running = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average)
    if running or mask is None or self.is_initializing():
      return super().__call__(x, use_running_average, mask=mask)
    mask = jnp.asarray(mask, bool)
    has_real = jnp.any(mask)
    old = {k: self.get_variable("batch_stats", k) for k in _STATS}
    y = super().__call__(x, use_running_average, mask=mask | ~has_real)
    for k, v in old.items():
      self.put_variable(
          "batch_stats", k,
          jnp.where(has_real, self.get_variable("batch_stats", k), v))
    return y


def _norm(train: bool, mask: jax.Array | None, momentum: float, dtype: Any,
          **kwargs) -> Any:
  """BatchNorm: masked batch statistics in training, running ones in eval."""
  bn = MaskedBatchNorm(use_running_average=not train, momentum=momentum, dtype=dtype, **kwargs)
  return functools.partial(bn, mask=mask if train else None)


def _add_shortcut(x: jax.Array, y: jax.Array, conv: Any, norm: Any, strides: int) -> jax.Array:
  """relu(shortcut + y): identity, or a strided 1x1 projection (`proj_conv`, `proj_norm`,
  named inside the calling block) when shapes differ."""
  if x.shape != y.shape:
    x = conv(y.shape[-1], (1, 1), strides, name="proj_conv")(x)
    x = norm(name="proj_norm")(x)
  return nn.relu(x + y)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with a (projected when needed) identity shortcut."""

  features: int
  strides: int = 1
  momentum: float = 0.9
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool,
               mask: jax.Array | None) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(_norm, train, mask, self.momentum, self.dtype)
    y = conv(self.features, (3, 3), self.strides, padding=1)(x)
    y = nn.relu(norm()(y))
    y = conv(self.features, (3, 3), padding=1)(y)
    # Zero-init of the last scale starts every block as the identity.
    y = norm(scale_init=nn.initializers.zeros)(y)
    return _add_shortcut(x, y, conv, norm, self.strides)


class BottleneckBlock(nn.Module):
  """1x1 reduce, 3x3 (strided: "v1.5", as the usual throughput tables), 1x1 expand to 4x."""

  features: int
  strides: int = 1
  momentum: float = 0.9
  dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, train: bool,
               mask: jax.Array | None) -> jax.Array:
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
    norm = functools.partial(_norm, train, mask, self.momentum, self.dtype)
    y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
    y = conv(self.features, (3, 3), self.strides, padding=1)(y)
    y = nn.relu(norm()(y))
    y = conv(4 * self.features, (1, 1))(y)
    y = norm(scale_init=nn.initializers.zeros)(y)
    return _add_shortcut(x, y, conv, norm, self.strides)


class ResNet(nn.Module):
  """ResNet with BasicBlocks; ResNet-18 by default.

  Attributes:
    num_classes: size of the output layer.
    width: channels of the first stage; stage i has `width * 2**i`.
    stage_sizes: blocks per stage ([2, 2, 2, 2] is ResNet-18).
    small_input: 3x3 stride-1 stem, no max-pool (CIFAR style) when True; 7x7 stride-2
      with max-pool (ImageNet) when False; None: small for inputs up to 64 pixels a side.
    momentum: decay of the BatchNorm running averages.
    dtype: computation dtype (parameters and statistics stay float32); None follows
      `--precision`.
  """

  num_classes: int
  width: int = 64
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  small_input: bool | None = None
  momentum: float = 0.9
  dtype: Any = None
  block: ClassVar[type[nn.Module]] = BasicBlock

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False,
               mask: jax.Array | None = None) -> jax.Array:
    """Logits for images `x [b, H, W, C]`; `train`: batch statistics (the running ones
    updated), else the running averages; only real examples (`mask` [b]: 1) count in them."""
    if mask is not None:
      mask = jnp.reshape(mask, (x.shape[0],) + (1,) * (x.ndim - 1))
    small = (max(x.shape[1], x.shape[2]) <= 64 if self.small_input is None
             else self.small_input)
    x = as_input(x, self.dtype)
    size, stride, pad = (3, 1, 1) if small else (7, 2, 3)
    x = nn.Conv(self.width, (size, size), stride, padding=pad, use_bias=False, dtype=self.dtype,
                name="stem_conv")(x)
    norm = _norm(train, mask, self.momentum, self.dtype, name="stem_norm")
    x = nn.relu(norm(x))
    if not small:
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, blocks in enumerate(self.stage_sizes):
      for j in range(blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = self.block(self.width * 2**i, strides, self.momentum, self.dtype,
                       name=f"stage{i + 1}_block{j + 1}")(x, train, mask)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)


class ResNet50(ResNet):
  """ResNet-50: bottleneck blocks [3, 4, 6, 3], 4 * `width` * 2**i channels out.

  The same attributes as `ResNet`; at width 64 with ImageNet-sized inputs
  it is the ResNet-50 of GPU throughput tables (161 parameter arrays, 106
  BatchNorm statistics).
  """

  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  block: ClassVar[type[nn.Module]] = BottleneckBlock
