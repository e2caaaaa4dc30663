"""A small decoder-only transformer language model (pre-LayerNorm, learned positions).

The LayerNorms compute the stable variance, not Flax's fast `E[x^2] - E[x]^2`,
whose cancellation amplifies the rounding of kernels of another shape
(`hetjax.fast_variance`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class DecoderBlock(nn.Module):
  """`x + attn(ln(x))`, then `x + mlp(ln(x))`."""

  num_heads: int
  mlp_ratio: int = 4
  dropout: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, causal_mask: jax.Array, train: bool = False) -> jax.Array:
    d_model = x.shape[-1]
    y = nn.LayerNorm(dtype=self.dtype, use_fast_variance=False)(x)
    # No projection biases: a key bias shifts every logit of a query equally,
    # so softmax ignores it and its gradient is zero up to rounding; Adam
    # would then turn rounding noise into full-size steps, and runs that sum
    # in another order (another split over hosts) would drift apart.
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype, dropout_rate=self.dropout,
        deterministic=not train, use_bias=False)(y, mask=causal_mask)
    x = x + nn.Dropout(self.dropout, deterministic=not train)(y)
    y = nn.LayerNorm(dtype=self.dtype, use_fast_variance=False)(x)
    y = nn.gelu(nn.Dense(self.mlp_ratio * d_model, dtype=self.dtype)(y))
    y = nn.Dense(d_model, dtype=self.dtype)(y)
    return x + nn.Dropout(self.dropout, deterministic=not train)(y)


class TransformerLM(nn.Module):
  """Maps tokens `[b, T]` to next-token logits `[b, T, vocab_size]` (causal: t sees 0..t).

  Attributes:
    vocab_size: number of token ids.
    d_model: residual stream width.
    num_layers: decoder blocks.
    num_heads: attention heads; must divide d_model.
    max_len: longest sequence the positional embedding covers.
    mlp_ratio: hidden width of each MLP, as a multiple of d_model.
    dropout: rate of dropout (attention weights, residual branches) in training.
    dtype: computation dtype (parameters stay float32).
    width: overrides `d_model` (the command line's `--model-width`).
  """

  vocab_size: int
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  max_len: int = 256
  mlp_ratio: int = 4
  dropout: float = 0.0
  dtype: Any = jnp.float32
  width: int | None = None

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
    length = tokens.shape[1]
    d_model = self.width or self.d_model
    if length > self.max_len:
      raise ValueError(f"Sequence length {length} exceeds max_len={self.max_len}; "
                       f"build the model with max_len >= {length}.")
    if d_model % self.num_heads:
      raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}.")
    x = nn.Embed(self.vocab_size, d_model, dtype=self.dtype,
                 name="token_embed")(tokens.astype(jnp.int32))
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.max_len, d_model))
    x = x + pos[:length].astype(self.dtype)
    causal_mask = nn.make_causal_mask(tokens)
    for i in range(self.num_layers):
      x = DecoderBlock(self.num_heads, self.mlp_ratio, self.dropout, self.dtype,
                       name=f"block{i + 1}")(x, causal_mask, train)
    x = nn.LayerNorm(dtype=self.dtype, use_fast_variance=False, name="final_norm")(x)
    return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x)
