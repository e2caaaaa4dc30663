"""A mode written here, through `hetjax.modes.base.Mode` alone, runs the whole lifecycle.

`EarlyStop` is sync with a fixed split (this one host takes the whole
global batch, one plain `jax.jit` step) and another stop rule: it ends the
run once a step's loss falls below a target. Nothing in hetjax knows it,
yet the Trainer records it, checks it, checkpoints it, resumes it,
evaluates it and summarises it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetjax
from hetjax import models as zoo
from hetjax.input import data
from hetjax.modes.base import Boundary, ModeBase
from hetjax.observe import metrics
from hetjax.task import MASK


class State(NamedTuple):
  params: Any
  opt_state: Any
  model_state: Any


class EarlyStop(ModeBase):
  """One host, the whole global batch per step; stops once the loss is below `target_loss`."""

  name = "early-stop"

  def __init__(self, target_loss: float):
    self.target_loss = target_loss

  def __repr__(self) -> str:
    return f"EarlyStop({self.target_loss})"

  def build(self, setup):
    self.setup, s = setup, setup
    params, model_state = jax.jit(s.task.init)(jax.random.key(s.config.seed), s.first_block)
    self.params, self.model_state = params, model_state
    self.opt_state = s.optimizer.init(params)
    self._step = 0

    def step(params, model_state, opt_state, batch, key):
      def mean_loss(p):
        losses, _, new_state = s.task.loss(p, model_state, batch, key)
        return jnp.mean(losses), new_state
      (loss, new_state), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
      updates, opt_state = s.optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), new_state, opt_state, loss

    self._jit_step = jax.jit(step)
    return self._saved_state(), {"mode": self.name}

  @property
  def step(self):
    return self._step

  def advance(self, loop):
    s = self.setup
    while self._step < loop.target:
      batch = s.source[s.sampler.indices(self._step)]
      batch[MASK] = np.ones(s.config.global_batch, np.float32)
      t0 = time.perf_counter()
      self.params, self.model_state, self.opt_state, loss = self._jit_step(
          self.params, self.model_state, self.opt_state, batch,
          jax.random.fold_in(jax.random.key(s.config.seed), self._step))
      loss = float(loss)
      seconds = time.perf_counter() - t0
      s.history.record([s.config.global_batch], seconds, loss, {"loss": loss}, compute_s=[seconds])
      s.history.arrived(s.history.steps - 1, wait_s=[0.0])
      self._step += 1
      yield Boundary(self._step, {"loss": loss})
      if loss < self.target_loss:
        return  # The stop rule: the run ends here, as a finished run.

  def current(self):
    return self.params, self.model_state

  def agreed(self):
    return self.params, "parameters"

  def _saved_state(self):
    return State(self.params, self.opt_state, self.model_state)

  def meta(self):
    return {"step": self._step}

  def saved(self, background):
    return self._saved_state(), None

  def restore(self, checkpointer, job, layout):
    restored = checkpointer.restore_latest(self._saved_state(), job)
    if restored is None:
      return None
    state, meta = restored
    self.params, self.opt_state, self.model_state = state
    self._step = meta["step"]
    return hetjax.modes.Resumed(self._step, meta)

  def summary_fields(self):
    return {"mode": self.name, "stop_rule": f"loss < {self.target_loss}"}


def test_a_mode_written_in_a_test_runs_through_the_protocol_alone(tmp_path):
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))
  config = hetjax.TrainConfig(global_batch=32, microbatch=8, check_every=2)
  ckpt = hetjax.CheckpointConfig(str(tmp_path / "ckpt"), every=3, async_save=False)
  make = lambda: hetjax.Trainer(task, optax.sgd(0.5), source, config, checkpoint=ckpt,
                                mode=EarlyStop(target_loss=1.5))
  tr, losses = make(), []
  summary = tr.fit(until=60, on_step=lambda t, m: losses.append(m["loss"]), out=str(tmp_path / "run"),
                   eval_source=source)
  tr.close()
  stopped = summary["last_step"]
  assert stopped < 60 and losses[-1] < 1.5 <= min(losses[:-1])  # Its own stop rule ended the run.
  assert summary["steps"] == stopped and summary["stop_rule"] == "loss < 1.5"
  assert summary["eval"]["step"] == stopped and 0 < summary["eval"]["accuracy"] <= 1
  records = metrics.read_records(str(tmp_path / "run"))
  assert [r["step"] for r in records] == list(range(1, stopped + 1))
  assert [r["loss"] for r in records] == losses
  again = make()  # Resumed from the checkpoint `fit` saved at its end.
  assert again.resumed_from == again.step == stopped
  jax.tree.map(np.testing.assert_array_equal, again.params(), tr.params())
  assert again.fit(until=stopped)["steps"] == 0  # Nothing left to run.
  again.close()
