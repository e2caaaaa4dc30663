"""Entry points of the mixed-precision tests, run as emulated clusters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data

OVERFLOW_STEP = 3
SHARES = (4, 4, 8)  # Host 1 holds positions 4..7 of every global batch.


def digits_accuracy(steps: int):
  """Test accuracy of the digits CNN trained in bf16 and in fp16 (3 hosts, uneven)."""
  hetjax.initialize()
  source, test = data.load("digits"), data.load("digits", "test")
  task = zoo.build("cnn", kind="image", num_classes=10)
  out = {}
  for precision in ("bf16", "fp16"):
    config = trainer.TrainConfig(global_batch=64, microbatch=8, assignment=(8, 24, 32),
                                 precision=precision)
    tr = trainer.Trainer(task, optax.adam(3e-3), source, config)
    summary = tr.fit(steps)
    out[precision] = {"accuracy": tr.evaluate(test)["accuracy"],
                      "final_metrics": summary["final_metrics"]}
    tr.close()
  return out


def _overflow_source(global_batch: int, seed: int, boom: bool) -> data.ArraySource:
  """Small, well-scaled regression data; with `boom`, one record whose gradient
  overflows fp16, placed on host 1 at step OVERFLOW_STEP."""
  rng = np.random.default_rng(0)
  n = 4096
  arrays = {"x": (0.05 * rng.normal(size=(n, 4))).astype(np.float32),
            "y": (0.05 * rng.normal(size=n)).astype(np.float32),
            "boom": np.zeros(n, np.float32)}
  if boom:
    sampler = data.GlobalSampler(n, global_batch, seed, name=data.ArraySource(arrays).info.name)
    arrays["boom"][sampler.indices(OVERFLOW_STEP)[SHARES[0] + 1]] = 1.0
  return data.ArraySource(arrays)


def _linear_task() -> hetjax.Task:
  def init(rng, batch):
    del batch
    return {"w": 0.1 * jax.random.normal(rng, (4,)), "b": jnp.zeros(())}

  def loss(params, batch, rng):
    del rng
    residual = batch["x"] @ params["w"] + params["b"] - batch["y"]
    # 1000 x the loss scale is far beyond fp16's 65504 in the backward pass.
    return residual ** 2 + batch["boom"] * 1000.0 * jnp.sum(params["w"]), {}

  return hetjax.from_functions(init, loss)


def overflow_run(boom: bool, steps: int = 6):
  """Per-step metrics and parameters of an fp16 run, with or without the bad record."""
  hetjax.initialize()
  source = _overflow_source(16, 0, boom)
  config = trainer.TrainConfig(global_batch=16, microbatch=4, assignment=SHARES, precision="fp16")
  tr = trainer.Trainer(_linear_task(), optax.sgd(0.1), source, config)
  params = [tr.params()]
  for _ in range(steps):
    tr.train_step()
    params.append(tr.params())
  metrics = tr.history.metrics
  tr.close()
  return {"metrics": metrics, "params": params}


def overflow_pair():
  """The same fp16 run without and with the injected overflow, in one launch."""
  return {"clean": overflow_run(False), "boom": overflow_run(True)}


def accuracy_and_overflow(steps: int):
  """Both multi-host precision checks on one 3-host cluster (its start-up is shared)."""
  return {"accuracy": digits_accuracy(steps), "overflow": overflow_pair()}
