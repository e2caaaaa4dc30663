"""Entry points that tests run as emulated multi-host clusters (hetjax.testing)."""

from __future__ import annotations

import jax
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import balancer, trainer
from hetjax.input import data

EXACTNESS_STEPS = 10
# Plain SGD moves the parameters by the gradient itself, so a normaliser off
# by a layout-dependent factor (say, divided by the hosts instead of the
# examples) changes the result; Adam divides most of such a factor out.
SGD_LR = 0.1


def optimizer(name: str, lr: float = 1e-3):
  """`adam` at `lr`, or plain SGD at `SGD_LR` (see above)."""
  return optax.sgd(SGD_LR) if name == "sgd" else optax.adam(lr)


def _trainer(model: str, dataset: str, *, assignment="equal", reduction="device",
             global_batch=64, microbatch=4, balancer_=None, lr=1e-3, optimizer_="adam",
             device_batch=1, **overrides) -> trainer.Trainer:
  source = data.load(dataset)
  task = zoo.build(model, kind=source.info.kind, num_classes=source.info.num_classes,
                             vocab_size=source.info.vocab_size, **overrides)
  config = trainer.TrainConfig(global_batch=global_batch, microbatch=microbatch,
                               assignment=assignment, reduction=reduction,
                               device_batch=device_batch)
  return trainer.Trainer(task, optimizer(optimizer_, lr), source, config, balancer=balancer_)


MODELS = {"mlp": ("digits", {}), "transformer": ("tokens", {"num_layers": 1})}


def train_params(model: str, assignment, reduction: str, steps: int = EXACTNESS_STEPS,
                 optimizer_: str = "adam"):
  """Final parameters of a short run (host numpy), plus the per-step shares."""
  hetjax.initialize()
  dataset, overrides = MODELS[model]
  tr = _trainer(model, dataset, assignment=assignment, reduction=reduction,
                optimizer_=optimizer_, **overrides)
  summary = tr.fit(steps)
  return tr.params(), summary


class Alternating:
  """A balancer that changes every host's share at every step."""

  name = "alternating"

  def __init__(self, splits):
    self.splits = splits

  def shares(self, step):
    return self.splits[step % len(self.splits)]

  def observe(self, step, shares, compute_s):
    pass


# Whole blocks of 4, with device batches (4, 2, 1). The two warm-up steps
# run only host 0's largest program (16 and 8 blocks) and nothing on host 1;
# then host 0 runs 7 blocks (4 + 2 + 1) and 1, host 1 5 (2 + 2 + 1): programs
# no earlier step ran, so they must have been compiled at the start.
MOVING_SPLITS = [(64, 0, 0), (32, 0, 32), (28, 0, 36), (4, 20, 40)]
MOVING_DEVICE_BATCHES = (4, 2, 1)


def compiles_while_shares_move(reduction: str = "device"):
  """Counts backend compilations after warm-up while the split changes every step.

  Each host runs its own device batch (`MOVING_DEVICE_BATCHES`): its ladder
  of programs is compiled at the start, and every share runs on it. The
  warm-up's own count is returned too (`in_warmup`): a listener that hears
  nothing would pass "none after".
  """
  hetjax.initialize()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  tr = _trainer("mlp", "digits", balancer_=Alternating(MOVING_SPLITS), reduction=reduction,
                device_batch=MOVING_DEVICE_BATCHES)
  tr.fit(2)
  warm = len(compiles)
  summary = tr.fit(6)
  return {"after_warmup": len(compiles) - warm, "in_warmup": warm, "shares": tr.history.shares,
          "params": tr.params(), "device_batches": summary["device_batches"]}


def mismatched_config():
  """Host 1 uses another seed: every host must refuse before training."""
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10)
  seed = 1 if jax.process_index() == 1 else 0
  try:
    trainer.Trainer(task, optax.adam(1e-3), source, trainer.TrainConfig(global_batch=64, seed=seed))
  except ValueError as e:
    return str(e)
  return None


def dynamic_balancing(steps: int = 36):
  """The dynamic balancer on a cluster where one host slows down mid-run."""
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=256, microbatch=16, balancer="dynamic")
  tr = trainer.Trainer(task, optax.adam(1e-3), source, config)
  summary = tr.fit(steps)
  return {"shares": tr.history.shares, "params": tr.params(), "decisions": summary["balancer_decisions"],
          "idle": [h["idle_fraction"] for h in summary["per_host"]]}


def one_host_reference(global_batch: int, microbatch: int, steps: int, optimizer_: str = "adam"):
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10)
  tr = trainer.Trainer(task, optimizer(optimizer_), source,
                       trainer.TrainConfig(global_batch=global_batch, microbatch=microbatch))
  tr.fit(steps)
  return tr.params()


def visible_devices():
  """What JAX lets this host use after `hetjax.initialize()`."""
  topo = hetjax.initialize()
  return {"host": topo.host_id, "hosts": topo.num_hosts, "local_devices": topo.local_devices,
          "cuda_visible_devices": jax.config.values["jax_cuda_visible_devices"]}


def cross_host_sum():
  """A cross-host sum through the CPU collectives (gloo): host ids + 1, summed."""
  from hetjax import mesh as mesh_lib
  hetjax.initialize()
  meshes = mesh_lib.Meshes.create()
  rows = mesh_lib.gather_host_values(np.array([jax.process_index() + 1.0]), meshes)
  return float(rows.sum())


def share_zero_moving_shares_and_mismatch():
  """Three tests' clusters in one 3-host start: share zero, moving shares, then a mismatch.

  The mismatch comes last: it leaves a trainer that refused to start.
  """
  return {"share_zero": train_params("mlp", (0, 32, 32), "device", optimizer_="sgd"),
          "moving": compiles_while_shares_move(),
          "mismatch": mismatched_config()}
