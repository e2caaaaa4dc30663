"""Decoders shaped as the field writes them, for the within-host sharding tests and bench.

`decoder(structure)`: a pre-norm causal decoder over the `tokens` data with
tied input/output embeddings, its layers stacked as
- 'scan': `nn.scan(nn.remat(Block), variable_axes={'params': 0}, split_rngs={'params': True})`
  (MaxText's and levanter's stacking; parameters `[layers, ...]`),
- 'loop': the same blocks in a Python loop,
- 'jit': the scanned model with its loss wrapped in `jax.jit`,
- 'nnx': NNX blocks made with `nnx.vmap` and run with `nnx.scan` (stacked `nnx.Param`s);
  'nnx-read': the same, its tied output reading the embedding outside `Embed`'s methods.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import hetjax

STRUCTURES = ("scan", "loop", "jit", "nnx")


class Block(nn.Module):
  width: int
  heads: int = 4

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.LayerNorm(use_fast_variance=False)(x)
    qkv = nn.Dense(3 * self.width)(h).reshape(*x.shape[:2], 3, self.heads, -1)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    x = x + nn.Dense(self.width)(nn.dot_product_attention(q, k, v, mask=causal).reshape(x.shape))
    h = nn.Dense(4 * self.width)(nn.LayerNorm(use_fast_variance=False)(x))
    return x + nn.Dense(self.width)(nn.gelu(h)), None


class Decoder(nn.Module):
  vocab: int
  width: int
  layers: int
  scanned: bool = True

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width)
    x = embed(tokens)
    if self.scanned:
      stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.layers)
      x, _ = stack(self.width, name="layers")(x, None)
    else:
      for i in range(self.layers):
        x, _ = Block(self.width, name=f"layer_{i}")(x)
    return embed.attend(nn.LayerNorm(use_fast_variance=False)(x))  # Tied output embedding.


def next_token(logits, batch):
  tokens = batch["x"]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  return jnp.mean(losses, axis=-1), {}


def decoder(structure: str, width: int = 256, layers: int = 4, vocab: int = 32) -> hetjax.Task:
  """The decoder task of one `structure` (see the module docstring)."""
  if structure.startswith("nnx"):
    return _nnx_decoder(width, layers, vocab, read=structure == "nnx-read")
  task = hetjax.from_linen(Decoder(vocab, width, layers, scanned=structure != "loop"),
                           next_token)
  if structure == "jit":
    task = dataclasses.replace(task, loss=jax.jit(task.loss), unmasked_loss=None)
  return task


def _nnx_decoder(width: int, layers: int, vocab: int, read: bool) -> hetjax.Task:
  from flax import nnx

  class NnxBlock(nnx.Module):
    def __init__(self, rngs):
      self.norm1, self.norm2 = nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(4, width, decode=False, rngs=rngs)
      self.up, self.down = nnx.Linear(width, 4 * width, rngs=rngs), nnx.Linear(4 * width, width,
                                                                                rngs=rngs)

    def __call__(self, x):
      causal = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
      x = x + self.attn(self.norm1(x), mask=causal)
      return x + self.down(nnx.gelu(self.up(self.norm2(x))))

  class NnxDecoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, width, rngs=rngs)
      self.blocks = nnx.vmap(lambda r: NnxBlock(r), in_axes=0, out_axes=0)(
          rngs.fork(split=layers))
      self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens):
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def run(block, x):
        return block(x)
      x = self.norm(run(self.blocks, self.embed(tokens)))
      return x @ self.embed.embedding[...].T if read else self.embed.attend(x)

  return hetjax.from_nnx(NnxDecoder(nnx.Rngs(0)), next_token)
