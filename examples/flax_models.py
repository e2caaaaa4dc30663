"""Your own Flax model, NNX or linen, with BatchNorm and Dropout, trained by hetjax.

Two things to get right, both shown here:
- BatchNorm and the padding mask. hetjax pads a block that is not full with
  copies of real rows and passes its mask (float32 `[b]`, 1 = real) to the
  `__call__` argument named by `mask_arg` (`from_linen(..., mask_arg="mask")`,
  the same for `from_nnx`). Statistics must ignore the copies:
  `nnx.BatchNorm` / `nn.BatchNorm` take a boolean mask shaped like the
  input's batch axis with the reduced axes kept, `[b, 1, 1, 1]` for NHWC
  images: `mask[:, None, None, None] > 0`. Give `mask` a default (None), so
  hetjax may skip it for blocks with no padding.
- Getting the trained model back. `trainer.params()` is a plain dict of the
  `nnx.Param` values; the BatchNorm statistics are model state,
  `trainer.state.model_state`. For NNX, `nnx.update(model, params)` and the
  same for the state; for linen, `{"params": params, **model_state}` is the
  variables dict `module.apply` takes.

Run it:

  .venv/bin/python examples/flax_models.py --steps 30

or from the command line (evaluation, checkpoints and the report included):

  .venv/bin/hetjax train --model examples.flax_models:nnx_task --dataset digits --steps 30
  .venv/bin/hetjax train --model examples.flax_models:linen_task --dataset digits

(a config file's `model-width: 16` and `dropout: 0.1` reach the factories' keywords).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx

import hetjax


def classification(logits, batch):
  """Per-example losses (not a mean) and a per-example metric."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32)}


class NnxNet(nnx.Module):
  """Conv -> BatchNorm -> ReLU -> Dropout -> Linear, on [b, 8, 8, 1] images."""

  def __init__(self, num_classes: int = 10, width: int = 8, dropout: float = 0.2, *,
               rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, width, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(dropout, rngs=rngs)
    self.head = nnx.Linear(width * 64, num_classes, rngs=rngs)

  def __call__(self, x, mask=None):
    # mask arrives as float [b]; BatchNorm wants bool [b, 1, 1, 1] for NHWC.
    x = self.bn(self.conv(x), mask=None if mask is None else mask[:, None, None, None] > 0)
    x = self.drop(jax.nn.relu(x))
    return self.head(x.reshape(x.shape[0], -1))


class LinenNet(nn.Module):
  """The same network in linen; `train` selects batch statistics and dropout."""

  num_classes: int = 10
  width: int = 8
  dropout: float = 0.2

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Conv(self.width, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(
        x, mask=None if mask is None else mask[:, None, None, None] > 0)
    x = nn.Dropout(self.dropout, deterministic=not train)(nn.relu(x))
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))


def nnx_task(num_classes: int = 10, width: int = 8, dropout: float = 0.2) -> hetjax.Task:
  """`--model examples.flax_models:nnx_task` (width, dropout: the config keys model-width, dropout)."""
  return hetjax.from_nnx(NnxNet(num_classes, width, dropout, rngs=nnx.Rngs(params=0, dropout=1)),
                         classification, mask_arg="mask")


def linen_task(num_classes: int = 10, width: int = 8, dropout: float = 0.2) -> hetjax.Task:
  """`--model examples.flax_models:linen_task` (width, dropout: the config keys model-width, dropout)."""
  return hetjax.from_linen(LinenNet(num_classes, width, dropout), classification,
                           mask_arg="mask")


def host_arrays(tree):
  """Global replicated arrays (what the trainer holds) as this host's numpy copies."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def train_nnx(steps: int) -> tuple[NnxNet, dict]:
  """Trains an NNX model and puts the trained values back into it."""
  model = NnxNet(rngs=nnx.Rngs(params=0, dropout=1))
  trainer = hetjax.Trainer(hetjax.from_nnx(model, classification, mask_arg="mask"),
                           optax.adam(3e-3),
                           hetjax.data.load("digits"),
                           hetjax.TrainConfig(global_batch=64, microbatch=16))
  summary = trainer.fit(steps=steps)
  # The model object is untouched by training: the trainer holds the values.
  nnx.update(model, trainer.params())                               # the nnx.Param values
  nnx.update(model, host_arrays(trainer.state.model_state))         # BatchNorm statistics
  trainer.close()
  return model, summary


def train_linen(steps: int) -> tuple[dict, dict]:
  """Trains a linen model; returns the variables `LinenNet().apply` takes."""
  trainer = hetjax.Trainer(hetjax.from_linen(LinenNet(), classification, mask_arg="mask"),
                           optax.adam(3e-3),
                           hetjax.data.load("digits"),
                           hetjax.TrainConfig(global_batch=64, microbatch=16))
  summary = trainer.fit(steps=steps)
  variables = {"params": trainer.params(), **host_arrays(trainer.state.model_state)}
  trainer.close()
  return variables, summary


def accuracy(predict, split: str = "test") -> float:
  """Accuracy of `predict(x) -> logits` on the digits' test split, in inference mode."""
  test = hetjax.data.load("digits", split)
  return float((np.asarray(predict(test.arrays["x"])).argmax(-1) == test.arrays["y"]).mean())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args()
  hetjax.initialize()
  model, _ = train_nnx(args.steps)
  model.eval()  # Running BatchNorm averages, no dropout.
  nnx_accuracy = accuracy(model)
  variables, _ = train_linen(args.steps)
  linen_accuracy = accuracy(lambda x: LinenNet().apply(variables, x, train=False))
  if jax.process_index() == 0:
    print(f"test accuracy: nnx {nnx_accuracy:.3f}, linen {linen_accuracy:.3f}")


if __name__ == "__main__":
  main()
