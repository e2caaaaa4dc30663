"""Entry points for the two-host stop, agreement and evaluation tests (run by run_hosts).

One function runs several scenarios in the same two processes: starting a
cluster costs seconds on a 2-core machine, a scenario a fraction of that.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import jax
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax import balancer, trainer
from hetjax.training import agreement
from hetjax.checkpoint import manager as checkpoint
from hetjax.input import data
from hetjax.cluster import signals

DIGITS = data.load("digits")


def _trainer(directory=None, *, custom_balancer=None, check_every=100, hidden=(32,)):
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=hidden)
  ckpt = None if directory is None else checkpoint.CheckpointConfig(directory, every=100, keep=2)
  return trainer.Trainer(task, optax.adam(1e-3), DIGITS,
                         trainer.TrainConfig(global_batch=64, microbatch=4, check_every=check_every),
                         balancer=custom_balancer, checkpoint=ckpt)


def _signal_on(host: int, after: int, signum: int):
  def on_step(tr, metrics):
    del metrics
    if tr.host_id == host and tr.step == after:
      os.kill(os.getpid(), signum)
  return on_step


def _stop(tr, on_step, until=50):
  """Runs until stopped; returns what every host saw."""
  try:
    tr.fit(until=until, on_step=on_step)
  except signals.Stopped as e:
    return {"kind": type(e).__name__, "step": e.step, "directory": e.directory,
            "exit_code": e.exit_code, "message": str(e)}
  return {"kind": None, "step": tr.step}


def _error(fn):
  try:
    fn()
  except (agreement.HostsDisagree, ValueError) as e:
    return f"{type(e).__name__}: {e}"
  return None


class _Permuted:
  """Host 1 reverses the split it is given: a host that decides differently."""
  name = "permuted"

  def __init__(self, host):
    self._inner, self._host = balancer.make_balancer((40, 24), 64, 2), host

  def shares(self, step):
    shares = self._inner.shares(step)
    return tuple(reversed(shares)) if self._host == 1 else shares

  def observe(self, *args):
    self._inner.observe(*args)


def _perturb_on(host: int, after: int):
  def on_step(tr, metrics):
    del metrics
    if tr.step == after and tr.host_id == host:
      # A fault in this host's replica (bad memory, a bad copy): its local
      # parameters change behind the trainer's back. Setting `tr.state` would
      # not do: a state that is set goes through the sharded update's gather,
      # which gives every host the same bits again.
      def bump(x):
        shards = [s.data + 1e-3 for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
      live = tr.mode.replica.applied()
      tr.mode.replica.live = live._replace(params=jax.tree.map(bump, live.params))
  return on_step


def stops_and_disagreements(ckpt_dir: str):
  hetjax.initialize()
  out = {}
  tr = _trainer()  # Reused: each scenario leaves it at a step boundary every host agrees on.
  out["sigint_host1_no_ckpt"] = _stop(tr, _signal_on(1, 3, signal.SIGINT))
  out["sigterm_host0_no_ckpt"] = _stop(tr, _signal_on(0, 6, signal.SIGTERM))
  honest, tr.mode.balancer = tr.mode.balancer, _Permuted(jax.process_index())
  # The mismatch raises at step 8; step 9, already in flight, is finished too,
  # so the trainer stands at a boundary whose step matches its state (10).
  out["permuted"] = _error(lambda: tr.fit(3))
  tr.mode.balancer = honest
  tr.config = dataclasses.replace(tr.config, check_every=2)
  out["perturbed"] = _error(lambda: tr.fit(6, on_step=_perturb_on(1, 12)))
  out["perturbed_from"] = tr.step
  saving = _trainer(ckpt_dir)
  out["sigint_host0_ckpt"] = _stop(saving, _signal_on(0, 4, signal.SIGINT))
  out["saved_steps"] = sorted(int(p) for p in os.listdir(ckpt_dir) if p.isdigit())
  out["other_model"] = _error(lambda: _trainer(hidden=(32,) if jax.process_index() == 0 else (16,)))
  out["evaluation"] = evaluation_over_hosts(saving)
  return out


def evaluation_over_hosts(tr):
  """Evaluation spread over two hosts, evenly, unevenly and all on one host."""
  test = data.load("digits", "test")
  from hetjax.training import evaluate
  ev = evaluate.Evaluator(tr.task, tr.meshes, 16)
  even = ev.evaluate(tr.state.params, tr.state.model_state, test, [1, 1])
  uneven = ev.evaluate(tr.state.params, tr.state.model_state, test, [5, 1])
  skewed = ev.evaluate(tr.state.params, tr.state.model_state, test, [0, 1])
  return {"even": even, "uneven": uneven, "skewed": skewed, "params": tr.params(),
          "host_ranges": evaluate.host_ranges(len(test), [5, 1])}


def reference_eval(params):
  """The same evaluation by plain numpy-fed jax on one process."""
  test = data.load("digits", "test")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
  batch = test[np.arange(len(test))]
  losses, metrics, _ = task.evaluation_loss()(params, {}, batch, jax.random.key(0))
  return {"loss": float(np.mean(losses)), **{k: float(np.mean(v)) for k, v in metrics.items()}}
