"""Host entries of tests/test_modes.py (run by hetjax.testing.run_hosts)."""

from __future__ import annotations

import numpy as np
import optax

import hetjax
import hetjax_models
from hetjax import data, trainer
from hetjax.modes import RoundsConfig
from hetjax.modes.trainer import RoundsTrainer

BLOCK = 8


def _tiny():
  return hetjax_models.build("mlp", kind="image", num_classes=10, hidden=(16,))


def degenerate(steps: int, global_batch: int, lr: float) -> dict:
  """Sync (equal split, SGD) and hybrid (1 local step each, SGD inside, outer SGD lr 1) on both backends."""
  hetjax.initialize()
  source = data.load("digits")
  out = {}
  for reduction in ("device", "host"):
    config = trainer.TrainConfig(global_batch=global_batch, microbatch=BLOCK, seed=1,
                                 reduction=reduction)
    sync = trainer.Trainer(_tiny(), optax.sgd(lr), source, config)
    initial = sync.params()
    sync.fit(steps)
    rounds = RoundsConfig(mode="hybrid", local_steps=(1,) * sync.num_hosts,
                          outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
    hybrid = RoundsTrainer(_tiny(), optax.sgd(lr), source, config, rounds)
    summary = hybrid.fit(until=steps)
    out[reduction] = {"initial": initial, "sync": sync.params(), "hybrid": hybrid.params(),
                      "positions": (summary["data_position"], steps * global_batch),
                      "compute_s": [h["compute_s"] for h in summary["per_host"]]}
    sync.close()
    hybrid.close()
  return out


def accuracy(mode: str, rounds: int, local_steps: tuple, lr: float, momentum: float | None = 0.9,
             adam: bool = False, **options) -> dict:
  """One mode on uneven local step counts; the centre's test accuracy."""
  from hetjax import runtime
  if not runtime.is_initialized():
    hetjax.initialize()
  source, test = data.load("digits"), data.load("digits", "test")
  task = hetjax_models.build("mlp", kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=48, microbatch=BLOCK, seed=0)
  inner = optax.adam(lr) if adam else optax.sgd(lr, momentum=momentum)
  tr = RoundsTrainer(task, inner, source, config,
                     RoundsConfig(mode=mode, local_steps=local_steps, **options))
  summary = tr.fit(until=rounds)
  return {"accuracy": tr.evaluate(test)["accuracy"], "taus": [h["tau"][-1] for h in summary["per_host"]],
          "samples": [h["batch"][-1] for h in summary["per_host"]],
          "digest": summary["params_digest"]}


def accuracies(specs: list) -> list:
  """`accuracy(*args, **kwargs)` for each `(args, kwargs)` on one cluster (one start-up)."""
  return [accuracy(*args, **kwargs) for args, kwargs in specs]


def resume(directory: str, mode: str, rounds: int, local_steps: tuple | None, stop_at: int) -> dict:
  """A run stopped at `stop_at` and resumed from its checkpoint; returns both digests."""
  from hetjax import checkpoint, runtime
  if not runtime.is_initialized():
    hetjax.initialize()
  source = data.load("digits")
  config = trainer.TrainConfig(global_batch=24, microbatch=BLOCK, seed=2)
  settings = RoundsConfig(mode=mode, local_steps=local_steps, outer_lr=0.5)
  make = lambda ckpt: RoundsTrainer(_tiny(), optax.sgd(0.05, momentum=0.9), source, config,
                                    settings, checkpoint=ckpt)
  out = {}
  if stop_at:
    reference = make(None)
    reference.fit(until=rounds)
    out["reference"] = trainer.params_digest(reference.params())
    first = make(checkpoint.CheckpointConfig(directory, every=2))
    first.fit(until=stop_at)
    first.close()
  second = make(checkpoint.CheckpointConfig(directory, every=2))
  out["resumed_from"] = second.resumed_from
  second.fit(until=rounds)
  second.close()
  out["resumed"] = trainer.params_digest(second.params())
  out["position"] = second.position
  return out
