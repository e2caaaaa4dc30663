"""Host entries of tests/test_modes.py (run by hetjax.testing.run_hosts)."""

from __future__ import annotations

import jax
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data
from hetjax import mesh as mesh_lib
from hetjax.config import RoundsConfig
from hetjax.modes import from_config

BLOCK = 8


def _tiny():
  return zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))


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
    hybrid = trainer.Trainer(_tiny(), optax.sgd(lr), source, config, mode=from_config(rounds))
    summary = hybrid.fit(until=steps)
    out[reduction] = {"initial": initial, "sync": sync.params(), "hybrid": hybrid.params(),
                      "positions": (summary["data_position"], steps * global_batch),
                      "compute_s": [h["compute_s"] for h in summary["per_host"]]}
    sync.close()
    hybrid.close()
  return out


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


def accuracy(mode: str, rounds: int, local_steps: tuple, lr: float, momentum: float | None = 0.9,
             adam: bool = False, out: str | None = None, check: bool = False, **options) -> dict:
  """One mode on uneven local step counts; the centre's test accuracy.

  Also every host's parameters after the last round's local steps (hybrid
  keeps them until the next round starts from the centre), gathered, so
  the caller can check the recorded spread against them. With `check`, the
  hosts' agreement is checked every quarter of the run, then once more
  after host 1's centre is bent (`bent_centre`): the message, as "check".
  """
  from hetjax.cluster import runtime
  if not runtime.is_initialized():
    hetjax.initialize()
  source, test = data.load("digits"), data.load("digits", "test")
  task = zoo.build("mlp", kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=48, microbatch=BLOCK, seed=0,
                               check_every=rounds // 4 if check else 0)
  inner = optax.adam(lr) if adam else optax.sgd(lr, momentum=momentum)
  tr = trainer.Trainer(task, inner, source, config,
                       mode=from_config(RoundsConfig(mode=mode, local_steps=local_steps, **options)))
  summary = tr.fit(until=rounds, out=out, eval_every=rounds // 2 if out else 0,
                   eval_source=test if out else None)
  mine = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tr.mode.host_params)
  hosts = mesh_lib.gather_host_values(_flat(mine), tr.meshes)
  result = {"accuracy": tr.evaluate(test)["accuracy"],
            "taus": [h["tau"][-1] for h in summary["per_host"]],
            "samples": [h["batch"][-1] for h in summary["per_host"]],
            "spread": [h["spread"][-1] for h in summary["per_host"]], "host_params": hosts,
            "digest": summary["params_digest"]}
  if check:
    result["check"] = bent_centre(tr)
  tr.close()
  return result


def bent_centre(tr: trainer.Trainer) -> str:
  """Host 1's copy of `tr`'s centre bent by 1e-3 in one parameter: the check's message."""
  from hetjax.training import agreement
  if tr.host_id == 1:  # One parameter, on this host's copy only.
    leaf = jax.tree.leaves(tr.mode.centre.params)[0]
    shards = [jax.device_put(np.asarray(s.data) + np.float32(1e-3), s.device)
              for s in leaf.addressable_shards]
    bent = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
    params = jax.tree.unflatten(jax.tree.structure(tr.mode.centre.params),
                                [bent] + jax.tree.leaves(tr.mode.centre.params)[1:])
    tr.mode.centre = tr.mode.centre._replace(params=params)
  # Checked at once: a round would heal the copy, as each slice of the new
  # centre comes from the one device that computed it (hetjax.step.sharding).
  try:
    tr.check_params_agree()
  except agreement.HostsDisagree as e:
    return str(e)
  return "no error"


def accuracies(specs: list) -> dict:
  """`accuracy(*args, **kwargs)` for each `(args, kwargs)` on one cluster (one start-up)."""
  return {"runs": [accuracy(*args, **kwargs) for args, kwargs in specs]}


def resume(directory: str, mode: str, rounds: int, local_steps: tuple | None, stop_at: int) -> dict:
  """A run stopped at `stop_at` and resumed from its checkpoint; returns both digests."""
  from hetjax.checkpoint import manager as checkpoint
  from hetjax.cluster import runtime
  if not runtime.is_initialized():
    hetjax.initialize()
  source = data.load("digits")
  config = trainer.TrainConfig(global_batch=24, microbatch=BLOCK, seed=2)
  settings = RoundsConfig(mode=mode, local_steps=local_steps, outer_lr=0.5)
  make = lambda ckpt: trainer.Trainer(_tiny(), optax.sgd(0.05, momentum=0.9), source, config,
                                      mode=from_config(settings), checkpoint=ckpt)
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
  out["position"] = second.mode.position
  return out
