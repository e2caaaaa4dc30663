"""hetjax's per-step overhead against a hand-written `jax.jit` training loop.

Run from the repository root:

  python bench/overhead.py [--model cnn] [--global-batch 256] [--steps 200] \
      [--repeats 5] [--microbatch M]

Both sides train the same model (`hetjax_models.build`) on sklearn digits with
`optax.adam(1e-3)`, on 1 host x 1 CPU device (no emulation, no HETJAX_*
variables), fed the same global batches (`GlobalSampler(...).indices(step)`,
a numpy gather, then a host-to-device transfer every step):

  plain:  one `jax.jit` step (donated state): mean loss via `task.loss`,
          `jax.grad`, the adam update; the loop blocks on the loss each step.
  hetjax: `Trainer(...).train_step()`, which reads its metrics each step.

After a warm-up that excludes compilation, the script repeats R times {N
steps plain; N steps hetjax} and reports the median of the per-repeat
throughput ratios hetjax / plain (interleaving cancels machine noise) and each
side's median samples/s. The default micro-batch is the global batch, so
hetjax runs one micro-batch per step, like the plain loop; a smaller
`--microbatch` shows the cost of accumulating over several. The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax import data as data_lib
from hetjax.task import Task
import hetjax_models

Batch = dict[str, np.ndarray]
TARGET = 0.95
WARMUP_STEPS = 5  # Per side, untimed: compilation and first transfers.
LEARNING_RATE = 1e-3
SEED = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line; `--microbatch` defaults to the global batch."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--model", default="cnn", choices=("mlp", "cnn", "resnet18"))
  parser.add_argument("--global-batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=200, help="timed steps per side per repeat")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--microbatch", type=int, default=None,
                      help="hetjax micro-batch (default: the global batch)")
  args = parser.parse_args(argv)
  if args.microbatch is None:
    args.microbatch = args.global_batch
  for name in ("global_batch", "steps", "repeats", "microbatch"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1.")
  return args


class PlainLoop:
  """The loop a JAX user would write by hand: gather, transfer, jitted step."""

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, global_batch: int):
    self.source = source
    self.sampler = data_lib.GlobalSampler(len(source), global_batch, SEED)
    self.mask = np.ones(global_batch, np.float32)  # Every example is real.
    self.key = jax.random.key(SEED)
    self.step = 0
    params, self.model_state = jax.jit(task.init)(self.key, self.batch(0))
    self.params, self.opt_state = params, jax.jit(optimizer.init)(params)
    self._step = jax.jit(_plain_step(task, optimizer), donate_argnums=(0, 1, 2))

  def batch(self, step: int) -> Batch:
    """The same global batch hetjax trains on at `step`, with an all-ones mask."""
    return {**self.source[self.sampler.indices(step)], "mask": self.mask}

  def train_step(self) -> float:
    """One step; blocks on the loss, as hetjax blocks on its metrics."""
    batch = jax.device_put(self.batch(self.step))
    rng = jax.random.fold_in(self.key, self.step)
    self.params, self.opt_state, self.model_state, loss = self._step(
        self.params, self.opt_state, self.model_state, batch, rng)
    self.step += 1
    return float(loss)


def _plain_step(task: Task, optimizer: optax.GradientTransformation) -> Callable:
  """Mean loss over the batch, its gradient and the optax update."""

  def step(params, opt_state, model_state, batch, rng):
    def mean_loss(p):
      losses, _, new_state = task.loss(p, model_state, batch, rng)
      return jnp.mean(losses), new_state

    (loss, new_state), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, new_state, loss

  return step


def seconds(train_step: Callable[[], Any], steps: int) -> float:
  """Wall-clock seconds for `steps` calls of `train_step`."""
  t0 = time.perf_counter()
  for _ in range(steps):
    train_step()
  return time.perf_counter() - t0


def measure(plain: PlainLoop, trainer: hetjax.Trainer, global_batch: int, steps: int,
            repeats: int) -> list[tuple[float, float]]:
  """Per repeat, (plain, hetjax) samples/s from back-to-back timed runs."""
  seconds(plain.train_step, WARMUP_STEPS)
  seconds(trainer.train_step, WARMUP_STEPS)
  rates = []
  for r in range(repeats):
    plain_s = seconds(plain.train_step, steps)
    hetjax_s = seconds(trainer.train_step, steps)
    rates.append((global_batch * steps / plain_s, global_batch * steps / hetjax_s))
    print(f"{r:>6d} {rates[-1][0]:>14,.0f} {rates[-1][1]:>14,.0f} "
          f"{rates[-1][1] / rates[-1][0]:>8.3f}", flush=True)
  return rates


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Builds both loops, measures them side by side, prints the table and JSON."""
  args = parse_args(argv)
  topo = hetjax.initialize()
  source = data_lib.load("digits")
  task = hetjax_models.build(args.model, kind=source.info.kind,
                             num_classes=source.info.num_classes)
  optimizer = optax.adam(LEARNING_RATE)
  plain = PlainLoop(task, optimizer, source, args.global_batch)
  trainer = hetjax.Trainer(task, optimizer, source, hetjax.TrainConfig(
      global_batch=args.global_batch, microbatch=args.microbatch, seed=SEED))
  print(f"hetjax overhead: model={args.model} global_batch={args.global_batch} "
        f"microbatch={args.microbatch} ({-(-args.global_batch // args.microbatch)} per step) "
        f"steps={args.steps} repeats={args.repeats}; {topo.num_hosts} host x "
        f"{topo.local_devices} {topo.platform} device, jax {jax.__version__}")
  print(f"{'repeat':>6} {'plain smp/s':>14} {'hetjax smp/s':>14} {'ratio':>8}")
  rates = measure(plain, trainer, args.global_batch, args.steps, args.repeats)
  result = {
      "model": args.model,
      "global_batch": args.global_batch,
      "microbatch": args.microbatch,
      "steps": args.steps,
      "repeats": args.repeats,
      "plain_samples_per_sec": round(statistics.median(p for p, _ in rates), 1),
      "hetjax_samples_per_sec": round(statistics.median(h for _, h in rates), 1),
      "ratio": round(statistics.median(h / p for p, h in rates), 4),
      "target": TARGET,
  }
  print(f"{'median':>6} {result['plain_samples_per_sec']:>14,.0f} "
        f"{result['hetjax_samples_per_sec']:>14,.0f} {result['ratio']:>8.3f}"
        f"   (target >= {TARGET})")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
