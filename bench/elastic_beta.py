"""How does elastic's `--elastic-beta` set its accuracy per round? (3 hosts, fixed uneven taus.)

Run: `.venv/bin/python bench/elastic_beta.py` (a few minutes on 2 cores).

Three host processes run elastic averaging on the MLP and the real digits
with `--local-steps 4,2,1` (uneven hosts, deterministic: no emulated
timing decides anything), global batch 48, inner SGD (or Adam), for each beta of
`--betas`; the centre's test accuracy is printed every `--every` rounds,
with the hosts' mean spread (`||x_i - mean||`) over the last `--every`
rounds. `--ema D` also evaluates an exponential moving average (decay D)
of the centre over rounds: if the EMA of a large-beta centre does as well
as a small-beta centre, beta acts through the centre's averaging over time.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def host_main(betas: list, rounds: int, every: int, optimizer: str, lr: float,
              momentum: float | None, ema: float | None) -> list:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import hetjax  # pylint: disable=g-import-not-at-top
  from hetjax import models as zoo
  from hetjax.input import data

  hetjax.initialize()
  source, test = data.load("digits"), data.load("digits", "test")
  test_batch = {**test[np.arange(len(test))], hetjax.MASK: np.ones(len(test), np.float32)}
  results = []
  for beta in betas:
    task = zoo.build("mlp", kind="image", num_classes=10)
    loss_fn = task.evaluation_loss()
    _, no_state = jax.jit(task.init)(jax.random.key(0), test_batch)
    assert not jax.tree.leaves(no_state), "the MLP keeps no model state"

    # The centre and its average scored by one function: the columns compare.
    @jax.jit
    def accuracy(params, loss_fn=loss_fn, no_state=no_state):
      _, metrics, _ = loss_fn(params, no_state, test_batch, jax.random.key(0))
      return jnp.mean(metrics["accuracy"])

    inner = optax.adam(lr) if optimizer == "adam" else optax.sgd(lr, momentum=momentum)
    tr = hetjax.Trainer(task, inner, source,
                        hetjax.TrainConfig(global_batch=48, microbatch=8, seed=0),
                        mode=hetjax.Elastic(beta=beta, local_steps=(4, 2, 1)))
    rows, average = [], None

    def evaluate(t, metrics):
      nonlocal average
      del metrics
      centre = t.params()
      if ema is not None:
        average = centre if average is None else jax.tree.map(
            lambda a, c: ema * a + (1 - ema) * c, average, centre)
      if t.step % every:
        return
      row = {"round": t.step, "accuracy": float(accuracy(centre))}
      if ema is not None:
        row["ema_accuracy"] = float(accuracy(average))
      recent = t.history.series["spread"][-every:]  # Known one round late: the last `every` known.
      row["spread"] = np.mean(recent, axis=0).round(4).tolist()
      rows.append(row)

    tr.fit(until=rounds, on_step=evaluate)
    tr.close()
    results.append({"beta": beta, "rows": rows})
  return results


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--betas", default="0.9,0.7,0.5,0.3")
  p.add_argument("--rounds", type=int, default=200)
  p.add_argument("--every", type=int, default=40)
  p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="inner optimizer")
  p.add_argument("--lr", type=float, default=0.05)
  p.add_argument("--momentum", type=float, default=0.9, help="inner SGD momentum (0: none)")
  p.add_argument("--ema", type=float, default=None, help="also evaluate an EMA of the centre")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from hetjax.testing import run_hosts  # pylint: disable=g-import-not-at-top

  betas = [float(b) for b in args.betas.split(",")]
  results = run_hosts("elastic_beta:host_main", hosts=3, timeout_s=3600,
                      args=(betas, args.rounds, args.every, args.optimizer, args.lr,
                            args.momentum or None, args.ema))[0]
  inner = f"SGD lr {args.lr} momentum {args.momentum}" if args.optimizer == "sgd" else \
      f"Adam lr {args.lr}"
  print(f"elastic, 3 hosts, --local-steps 4,2,1, MLP on digits, {inner}; centre's test "
        f"accuracy (EMA {args.ema}) and mean spread per host")
  for r in results:
    for row in r["rows"]:
      shown = f"  ema {row['ema_accuracy']:.4f}" if "ema_accuracy" in row else ""
      print(f"beta {r['beta']:<4g} round {row['round']:4d}  accuracy {row['accuracy']:.4f}{shown}"
            f"  spread {row['spread']}")
  out = {"optimizer": args.optimizer, "lr": args.lr, "momentum": args.momentum, "ema": args.ema, "results": results}
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
