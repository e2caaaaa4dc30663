"""A model hetjax has never seen, trained on 1 host or on N uneven hosts.

  python examples/custom_model.py --out params_1host.npz
  python launch/local.py --hosts 3 --speeds 1,0.5,0.25 -- \
      python examples/custom_model.py --assignment 8,24,32 --out params_3hosts.npz
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


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--assignment", default="equal")
  parser.add_argument("--out", default="params.npz")
  args = parser.parse_args()
  hetjax.initialize()  # One host, or the cluster that the launcher describes.
  data = np.random.default_rng(0)  # Your own arrays, with a common first axis.
  x = data.normal(size=(2048, 8, 8)).astype(np.float32)
  y = ((x.sum((1, 2)) > 0) + 2 * (x[:, 0, 0] > 0)).astype(np.int32)
  trainer = hetjax.Trainer(
      hetjax.from_functions(init, per_example_loss), optax.adam(1e-3),
      hetjax.ArraySource({"x": x, "y": y}),
      hetjax.TrainConfig(global_batch=64, microbatch=8, assignment=args.assignment))
  summary = trainer.fit(steps=20)
  if jax.process_index() == 0:
    np.savez(args.out, *jax.tree.leaves(trainer.params()))
    shares = [host["batch"][-1] for host in summary["per_host"]]
    print(f"loss {summary['final_loss']:.4f}, shares {shares}, {summary['samples_per_sec']:.0f} samples/s")


if __name__ == "__main__":
  main()
