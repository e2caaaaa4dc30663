"""Entry points for the multi-host checkpoint tests (run by hetjax.testing.run_hosts)."""

from __future__ import annotations

import os
import signal

import optax

import hetjax
import hetjax_models
from hetjax import checkpoint, data, trainer


def _trainer(directory: str | None, assignment="equal") -> trainer.Trainer:
  hetjax.initialize()
  source = data.load("digits")
  task = hetjax_models.build("mlp", kind="image", num_classes=10, hidden=(32,))
  ckpt = None if directory is None else checkpoint.CheckpointConfig(directory, every=3, keep=2)
  return trainer.Trainer(task, optax.adam(1e-3), source,
                         trainer.TrainConfig(global_batch=64, microbatch=4, assignment=assignment),
                         checkpoint=ckpt)


def train_until(directory: str | None, until: int, assignment="equal"):
  """Trains (resuming from `directory` if it holds a checkpoint) up to step `until`."""
  tr = _trainer(directory, assignment)
  tr.fit(until=until)
  return {"resumed_from": tr.resumed_from, "params": tr.params(),
          "shares": tr.history.shares}


def preempt_resume_and_reference(directory: str, sigterm_host: int, sigterm_after: int, until: int):
  """SIGTERM to one host mid-run; then resume; then an uninterrupted run to compare."""
  def sigterm_self(tr, metrics):
    del metrics
    if tr.host_id == sigterm_host and tr.step == sigterm_after:
      os.kill(os.getpid(), signal.SIGTERM)

  first = _trainer(directory)
  try:
    first.fit(until=until, on_step=sigterm_self)
    preempted = None
  except trainer.Preempted as e:
    preempted = e.step
  resumed = _trainer(directory)
  resumed_from = resumed.resumed_from
  resumed.fit(until=until)
  digest = hetjax.params_digest(resumed.params())
  ref = _trainer(None)
  ref.fit(until=until)
  reference = hetjax.params_digest(ref.params())
  return {"preempted": preempted, "steps_done_first": first.step, "resumed_from": resumed_from,
          "digest": digest, "reference": reference}
