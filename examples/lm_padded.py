"""A decoder LM on padded sequences of different lengths, averaged over tokens.

The model is written as in a plain Flax loop: layers stacked with
`nn.scan` and rematerialised with `nn.remat`, attention that takes its
padding mask as `mask=`. Two lines make it hetjax's:
- `call_args={"mask": "x_mask"}` hands the batch's token padding mask to
  the module's `mask=` (hetjax passes nothing by an argument's name);
- the built-in `next_token` loss returns `hetjax.Weighted(sum of token
  losses, token count)` per sequence, so the update is the mean over every
  real token of the global batch, however sequences of different lengths
  fall on uneven hosts: a plain loop's `sum(losses * mask) / sum(mask)`.
  Returning each sequence's mean instead would weight the tokens of short
  sequences more: another objective.
tests/test_lm_padded.py checks it against a plain optax loop on 3 uneven
hosts and with sharding within a host.

  .venv/bin/python examples/lm_padded.py --steps 30
  .venv/bin/python launch/local.py --hosts 3 --speeds 1,0.5,0.25 -- \\
      .venv/bin/python examples/lm_padded.py --assignment 32,16,16
  .venv/bin/hetjax train --model examples.lm_padded:task --dataset examples.lm_padded:dataset \\
      --optimizer adamw --lr 3e-3 --weight-decay 0.01 --global-batch 64 --microbatch 8 \\
      --steps 50 --out runs/lm_padded
"""
import argparse

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax.models.losses import TOKEN_MASK, next_token

VOCAB, MAX_LEN = 32, 16


class Block(nn.Module):
  """Pre-LayerNorm: `x + attention(ln(x), mask)`, then `x + mlp(ln(x))`."""

  num_heads: int

  @nn.compact
  def __call__(self, x, mask):
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(nn.LayerNorm()(x), mask=mask)
    x = x + y
    y = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))
    return x + y, None


class PaddedLM(nn.Module):
  """Tokens `[b, T]` (and their padding mask) to next-token logits `[b, T, vocab_size]`."""

  vocab_size: int = VOCAB
  width: int = 32
  num_layers: int = 2
  num_heads: int = 2

  @nn.compact
  def __call__(self, tokens, mask=None):
    """`mask`: `[b, T]`, 1 for a real token and 0 for padding (None: all real)."""
    x = nn.Embed(self.vocab_size, self.width)(tokens)
    x = x + self.param("pos_embed", nn.initializers.normal(0.02), (MAX_LEN, self.width))[
        :tokens.shape[1]]
    attend = nn.make_causal_mask(tokens)
    if mask is not None:
      attend = nn.combine_masks(attend, nn.make_attention_mask(mask > 0, mask > 0))
    layers = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=nn.broadcast, length=self.num_layers)
    x, _ = layers(self.num_heads, name="layers")(x, attend)
    return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def task(vocab_size: int = VOCAB, width: int = 32) -> hetjax.Task:
  """`--model examples.lm_padded:task` (width: the config key model-width)."""
  return hetjax.from_linen(PaddedLM(vocab_size, width), next_token,
                           call_args={"mask": TOKEN_MASK})


def arrays(size: int, seed: int) -> dict[str, np.ndarray]:
  """Counting sequences (start, start + step, ...) mod VOCAB of lengths 3 to MAX_LEN, padded
  with 0 on the right: `x` int32 `[size, MAX_LEN]`, `x_mask` float32, 1 for a real token."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, MAX_LEN + 1, size)
  start, step = rng.integers(0, VOCAB, (2, size, 1))
  mask = (np.arange(MAX_LEN) < lengths[:, None]).astype(np.float32)
  tokens = (start + (step % 4 + 1) * np.arange(MAX_LEN)) % VOCAB
  return {"x": (tokens * mask).astype(np.int32), TOKEN_MASK: mask}


def dataset():
  """`--dataset examples.lm_padded:dataset`: (training source, evaluation source)."""
  info = hetjax.DatasetInfo("padded-counting", "tokens", vocab_size=VOCAB)
  return hetjax.ArraySource(arrays(4096, 0), info), hetjax.ArraySource(arrays(512, 1), info)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--assignment", default="equal")
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args()
  hetjax.initialize()  # One host, or the cluster that the launcher describes.
  train, test = dataset()
  trainer = hetjax.Trainer(task(), optax.adamw(3e-3, weight_decay=0.01), train,
                           hetjax.TrainConfig(global_batch=64, microbatch=8,
                                              assignment=args.assignment))
  summary = trainer.fit(steps=args.steps)
  print(f"loss per token {summary['final_loss']:.4f}, test {trainer.evaluate(test)}")
  trainer.close()


if __name__ == "__main__":
  main()
