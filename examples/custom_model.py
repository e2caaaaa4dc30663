"""A model hetjax has never seen, trained on 1 host or on N uneven hosts.

From a script of your own:

  .venv/bin/python examples/custom_model.py --out params_1host.npz
  .venv/bin/python launch/local.py --hosts 3 --speeds 1,0.5,0.25 -- \
      .venv/bin/python examples/custom_model.py --assignment 8,24,32 --out params_3hosts.npz

or from the command line, which adds evaluation, checkpoints, signals,
metrics and the report (the same parameters as the script):

  .venv/bin/hetjax train --model examples.custom_model:task --dataset examples.custom_model:dataset \
      --optimizer adam --lr 1e-3 --global-batch 64 --microbatch 8 --steps 20 --out runs/custom
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax


def init(rng, batch):
  k1, k2 = jax.random.split(rng)
  return {"w1": jax.random.normal(k1, (64, 32)) / 8, "b1": jnp.zeros(32),
          "w2": jax.random.normal(k2, (32, 4)) / 6, "b2": jnp.zeros(4)}


def per_example_loss(params, batch, rng):
  """Losses per example (not a mean): hetjax weights the hosts by their counts."""
  x = batch["x"].reshape(batch["x"].shape[0], -1)
  logits = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32)}


def task() -> hetjax.Task:
  """`--model examples.custom_model:task`: the model as hetjax trains it."""
  return hetjax.from_functions(init, per_example_loss)


def _arrays(size: int, seed: int) -> dict[str, np.ndarray]:
  data = np.random.default_rng(seed)  # Your own arrays, with a common first axis.
  x = data.normal(size=(size, 8, 8)).astype(np.float32)
  y = ((x.sum((1, 2)) > 0) + 2 * (x[:, 0, 0] > 0)).astype(np.int32)
  return {"x": x, "y": y}


def dataset():
  """`--dataset examples.custom_model:dataset`: (training source, evaluation source)."""
  info = hetjax.DatasetInfo("custom-arrays", "custom", num_classes=4)
  return (hetjax.ArraySource(_arrays(2048, 0), info),
          hetjax.ArraySource(_arrays(512, 1), info))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--assignment", default="equal")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", default="params.npz")
  args = parser.parse_args()
  hetjax.initialize()  # One host, or the cluster that the launcher describes.
  train_source, _ = dataset()
  trainer = hetjax.Trainer(
      task(), optax.adam(1e-3), train_source,
      hetjax.TrainConfig(global_batch=64, microbatch=8, assignment=args.assignment))
  summary = trainer.fit(steps=args.steps)
  if jax.process_index() == 0:
    np.savez(args.out, *jax.tree.leaves(trainer.params()))
    shares = [host["batch"][-1] for host in summary["per_host"]]
    print(f"loss {summary['final_loss']:.4f}, shares {shares}, {summary['samples_per_sec']:.0f} samples/s")


if __name__ == "__main__":
  main()
