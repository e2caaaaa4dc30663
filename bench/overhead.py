"""hetjax's per-step overhead against a hand-written `jax.jit` training loop.

Run from the repository root (all four models in one run, a few minutes):

  .venv/bin/python bench/overhead.py [--models mlp,cnn,resnet18,resnet50] \
      [--precision fp32|bf16|fp16] [--repeats 21] [--steps N] [--microbatch M]

All three loops train the same model (`zoo.build`) on sklearn digits with
`optax.adam(1e-3)`, on 1 host x 1 CPU device (no emulation, no HETJAX_*
variables), fed the same global batches (`GlobalSampler(...).indices(step)`,
a numpy gather, then a host-to-device transfer every step):

  plain:  one `jax.jit` step (donated state): mean loss via `task.loss`,
          `jax.grad`, the adam update; it reads each step's loss one step
          late, as a logging loop does without stalling the device.
  split:  the same loop with its step cut in two programs where a cross-host
          reduction must sit: gradient, then update. It measures, with no
          hetjax code, what that boundary costs: on XLA:CPU the one-program
          step overlaps the update's small per-leaf kernels with the backward
          pass on the other core, which two programs cannot.
  hetjax: `Trainer(...).fit(N)`, the loop users run: it overlaps steps
          (fetches a step's statistics after dispatching the next); the
          end-of-run summary it returns is inside the timed run.

Each model runs at a width and global batch that keep its step short on this
CPU (`SETTINGS`): per-step overhead matters most where the step is short, as
on a GPU. After a warm-up that excludes compilation, the script repeats R
times {N steps plain; N steps split; N steps hetjax}, each timed run ending when its last
step's results are ready, and reports per model the median of the
per-repeat throughput ratios hetjax / plain (interleaving cancels machine
noise), the milliseconds hetjax adds to a step, and the leaf count (parameter
arrays, and with the model state such as BatchNorm statistics). The default
micro-batch is the global batch, so hetjax runs one micro-batch per step,
like the plain loop. The split columns give the same figures for the split
loop against plain. The last line printed is one JSON object with `ratio`
and `added_ms` per model (hetjax against plain), and `ratio_vs_split` /
`added_vs_split_ms` per model in `models`, with the quartiles of the
per-repeat added ms (`added_ms_quartiles`): on a shared machine they say
how much one run's median can be trusted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax.input import data as data_lib
from hetjax.task import Task
from hetjax import models as zoo

Batch = dict[str, np.ndarray]
TARGET = 0.95
TARGET_ADDED_MS = 1.0
WARMUP_STEPS = 5  # Per side, untimed: compilation and first transfers.
LEARNING_RATE = 1e-3
SEED = 0
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class Setting:
  """How one model is measured: its global batch, overrides, timed steps."""

  global_batch: int
  steps: int
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


SETTINGS = {
    "mlp": Setting(256, 200),
    "cnn": Setting(256, 40),
    "resnet18": Setting(32, 10, {"width": 16}),
    "resnet50": Setting(32, 10, {"width": 8}),
}


def model_names(parser: argparse.ArgumentParser, text: str) -> list[str]:
  """`--models`' comma-separated names, each one of `SETTINGS` (else a usage error)."""
  names = [m.strip() for m in text.split(",") if m.strip()]
  unknown = [m for m in names if m not in SETTINGS]
  if unknown or not names:
    parser.error(f"--models {unknown or '(none)'}: choose from {', '.join(SETTINGS)}.")
  return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line; `--microbatch` defaults to each model's global batch."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--models", default=",".join(SETTINGS),
                      help=f"comma-separated, from {', '.join(SETTINGS)}")
  parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
  parser.add_argument("--steps", type=int, default=None,
                      help="timed steps per side per repeat (default: per model)")
  parser.add_argument("--repeats", type=int, default=21)
  parser.add_argument("--microbatch", type=int, default=None,
                      help="hetjax micro-batch (default: the global batch)")
  args = parser.parse_args(argv)
  args.models = model_names(parser, args.models)
  for name in ("steps", "repeats", "microbatch"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name} must be >= 1, got {value}.")
  return args


class PlainLoop:
  """The loop a JAX user would write by hand: gather, transfer, jitted step.

  `programs=2` splits the step where any cross-host reduction must sit:
  one program for the loss and gradient, one for the adam update. On
  XLA:CPU one program overlaps the update's many small kernels with the
  backward pass on the other core; two cannot, so the split loop measures
  what that boundary costs with no hetjax code at all.
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, global_batch: int, precision: str,
               programs: int = 1):
    if programs not in (1, 2):
      raise ValueError(f"programs must be 1 or 2, got {programs}.")
    self.source = source
    self.sampler = data_lib.GlobalSampler(len(source), global_batch, SEED)
    self.mask = np.ones(global_batch, np.float32)  # Every example is real.
    self.key = jax.random.key(SEED)
    self.step = 0
    self.losses: list[float] = []
    self._pending = None
    params, self.model_state = jax.jit(task.init)(self.key, self.batch(0))
    self.params, self.opt_state = params, jax.jit(optimizer.init)(params)
    grad, update = _plain_grad(task, precision), _plain_update(optimizer, precision)
    if programs == 1:
      def step(params, opt_state, model_state, batch, rng):
        loss, grads, new_state = grad(params, model_state, batch, rng)
        return (*update(params, opt_state, grads), new_state, loss)
      self._step = jax.jit(step, donate_argnums=(0, 1, 2))
    else:
      grad_program = jax.jit(grad)
      update_program = jax.jit(update, donate_argnums=(0, 1))
      def step(params, opt_state, model_state, batch, rng):
        loss, grads, new_state = grad_program(params, model_state, batch, rng)
        return (*update_program(params, opt_state, grads), new_state, loss)
      self._step = step

  def batch(self, step: int) -> Batch:
    """The same global batch hetjax trains on at `step`, with an all-ones mask."""
    return {**self.source[self.sampler.indices(step)], "mask": self.mask}

  def train_step(self) -> None:
    """One step; reads the previous step's loss once this one is dispatched."""
    batch = jax.device_put(self.batch(self.step))
    rng = jax.random.fold_in(self.key, self.step)
    self.params, self.opt_state, self.model_state, loss = self._step(
        self.params, self.opt_state, self.model_state, batch, rng)
    self.step += 1
    if self._pending is not None:
      self.losses.append(float(self._pending))
    self._pending = loss

  def run(self, steps: int) -> None:
    for _ in range(steps):
      self.train_step()

  def wait(self) -> None:
    jax.block_until_ready((self.params, self._pending))


_COMPUTE = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
_FP16_SCALE = 2.0 ** 15  # A hand-written loop's fixed loss scale.


def _plain_grad(task: Task, precision: str) -> Callable:
  """Mean loss over the batch and its float32 gradient.

  Low precision the way a hand-written loop does it: float32 parameters
  cast to the compute type inside the loss; fp16 with a fixed loss scale.
  """
  compute = _COMPUTE[precision]
  scale = _FP16_SCALE if precision == "fp16" else 1.0
  low = lambda t: jax.tree.map(
      lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)

  def grad(params, model_state, batch, rng):
    inputs = {k: v if k == "mask" else low(v) for k, v in batch.items()}

    def mean_loss(p):
      losses, _, new_state = task.loss(low(p), model_state, inputs, rng)
      return jnp.mean(losses.astype(jnp.float32)) * scale, new_state

    (loss, new_state), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    return loss / scale, grads, new_state

  return grad


def _plain_update(optimizer: optax.GradientTransformation, precision: str) -> Callable:
  """The optax update; under fp16 skipped when a gradient is not finite."""

  def update(params, opt_state, grads):
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if precision == "fp16":
      finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
      new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
    return new_params, new_opt

  return update


class HetjaxLoop:
  """`Trainer.fit`, waited on at the end of a timed run like the plain loop."""

  def __init__(self, trainer: hetjax.Trainer):
    self.trainer = trainer

  def run(self, steps: int) -> None:
    self.trainer.fit(steps)

  def wait(self) -> None:
    # Not `Trainer.state`: reading it applies the last update alone, where the
    # next `fit` applies it inside its first program.
    self.trainer.mode.block_until_ready()


def seconds(loop: PlainLoop | HetjaxLoop, steps: int) -> float:
  """Wall-clock seconds for `steps` steps and their results."""
  t0 = time.perf_counter()
  loop.run(steps)
  loop.wait()
  return time.perf_counter() - t0


def leaf_counts(trainer: hetjax.Trainer) -> tuple[int, int]:
  """(parameter arrays, parameter + model-state arrays) of the trained model."""
  state = trainer.mode.local_state
  params = len(jax.tree.leaves(state.params))
  return params, params + len(jax.tree.leaves(state.model_state))


LOOPS = ("plain", "split", "hetjax")


def make_loops(task: Task, source: data_lib.ArraySource, global_batch: int, microbatch: int,
               precision: str, labels: tuple[str, ...] = LOOPS) -> dict[str, Any]:
  """The loops named in `labels` (from `LOOPS`), each training `task` with adam."""
  optimizer = optax.adam(LEARNING_RATE)
  loops: dict[str, Any] = {}
  for label in labels:
    if label in ("plain", "split"):
      loops[label] = PlainLoop(task, optimizer, source, global_batch, precision,
                               programs=1 if label == "plain" else 2)
    elif label == "hetjax":
      loops[label] = HetjaxLoop(hetjax.Trainer(task, optimizer, source, hetjax.TrainConfig(
          global_batch=global_batch, microbatch=microbatch, seed=SEED, precision=precision)))
    else:
      raise ValueError(f"unknown loop {label!r}; choose from {', '.join(LOOPS)}.")
  return loops


def time_loops(loops: dict[str, Any], steps: int, repeats: int) -> dict[str, list[float]]:
  """Per-repeat ms per step of each loop, after an untimed warm-up, interleaved.

  Interleaving puts every loop under the same machine noise, so the paired
  per-repeat ratios (`paired`) cancel most of it.
  """
  for loop in loops.values():
    seconds(loop, WARMUP_STEPS)
  ms: dict[str, list[float]] = {label: [] for label in loops}
  for _ in range(repeats):
    for label, loop in loops.items():
      ms[label].append(seconds(loop, steps) / steps * 1e3)
  return ms


def paired(ms: dict[str, list[float]], base: str, other: str) -> dict[str, Any]:
  """`other` against `base`: median throughput ratio, ms added, quartiles of the ms added."""
  added = [y - x for x, y in zip(ms[base], ms[other])]
  return {
      "ratio": round(statistics.median(x / y for x, y in zip(ms[base], ms[other])), 4),
      "added_ms": round(statistics.median(added), 3),
      # The spread says how far one run's median can be trusted on a shared machine.
      "added_ms_quartiles": ([round(q, 3) for q in statistics.quantiles(added, n=4)[::2]]
                             if len(added) > 1 else None),
  }


def measure_model(name: str, args: argparse.Namespace, source: data_lib.ArraySource) -> dict:
  """Builds the three loops for `name`, times them interleaved, returns its figures."""
  setting = SETTINGS[name]
  batch, steps = setting.global_batch, args.steps or setting.steps
  microbatch = args.microbatch or batch
  task = zoo.build(name, kind=source.info.kind, num_classes=source.info.num_classes,
                   **setting.overrides)
  loops = make_loops(task, source, batch, microbatch, args.precision)
  ms = time_loops(loops, steps, args.repeats)
  trainer = loops["hetjax"].trainer
  params, leaves = leaf_counts(trainer)
  trainer.close()
  split, vs_split = paired(ms, "plain", "split"), paired(ms, "split", "hetjax")
  return {
      "global_batch": batch, "microbatch": microbatch, "steps": steps,
      "overrides": setting.overrides, "param_leaves": params, "leaves": leaves,
      **{f"{label}_ms": round(statistics.median(v), 3) for label, v in ms.items()},
      **paired(ms, "plain", "hetjax"),
      "split_ratio": split["ratio"], "split_added_ms": split["added_ms"],
      "ratio_vs_split": vs_split["ratio"], "added_vs_split_ms": vs_split["added_ms"],
  }


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Measures every model side by side, prints the table and the JSON line."""
  args = parse_args(argv)
  topo = hetjax.initialize()
  source = data_lib.load("digits")
  print(f"hetjax overhead: precision={args.precision} repeats={args.repeats}; "
        f"{topo.num_hosts} host x {topo.local_devices} {topo.platform} device, "
        f"jax {jax.__version__}")
  print(f"{'model':>9} {'batch':>5} {'leaves':>11} {'plain ms':>9} {'hetjax ms':>9} "
        f"{'added ms':>8} {'ratio':>6} | {'split ms':>8} {'added':>6} {'ratio':>6}")
  rows = {}
  for name in args.models:
    r = rows[name] = measure_model(name, args, source)
    print(f"{name:>9} {r['global_batch']:>5} {r['param_leaves']:>4} ({r['leaves']:>4}) "
          f"{r['plain_ms']:>9.2f} {r['hetjax_ms']:>9.2f} {r['added_ms']:>8.2f} "
          f"{r['ratio']:>6.3f} | {r['split_ms']:>8.2f} {r['split_added_ms']:>6.2f} "
          f"{r['split_ratio']:>6.3f}", flush=True)
  print(f"targets: ratio >= {TARGET}, added <= {TARGET_ADDED_MS} ms per step; leaves: "
        "parameter arrays (with model state); split: the plain loop as two programs "
        "(gradient, then update), no hetjax code")
  result = {
      "precision": args.precision, "repeats": args.repeats, "models": rows,
      "ratio": {n: r["ratio"] for n, r in rows.items()},
      "added_ms": {n: r["added_ms"] for n, r in rows.items()},
  }
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
