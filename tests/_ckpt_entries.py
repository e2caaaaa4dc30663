"""Entry points for the multi-host checkpoint tests (run by hetjax.testing.run_hosts)."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import jax
import optax
from jax.experimental import multihost_utils

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.checkpoint import manager as checkpoint
from hetjax.input import data


def _trainer(directory: str | None, assignment="equal", sgd: bool = False) -> trainer.Trainer:
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
  ckpt = None if directory is None else checkpoint.CheckpointConfig(directory, every=3, keep=2)
  return trainer.Trainer(task, optax.sgd(0.1) if sgd else optax.adam(1e-3), source,
                         trainer.TrainConfig(global_batch=64, microbatch=4, assignment=assignment),
                         checkpoint=ckpt)


def train_until(directory: str | None, until: int, assignment="equal", sgd: bool = True):
  """Trains (resuming from `directory` if it holds a checkpoint) up to step `until`.

  Plain SGD by default: runs on other layouts are compared with one host, and
  SGD, unlike Adam, shows a normaliser off by a layout-dependent factor.
  """
  tr = _trainer(directory, assignment, sgd)
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


def hand_over_held_on_one_host(directory: str, held_host: int, until: int):
  """One host's hand-over of step 3 waits on its worker while the job trains on.

  Host `held_host` holds its worker before orbax is called until it has
  trained step 5; meanwhile the other hosts' workers wait for it at orbax's
  first barrier and every main thread runs steps 4 and 5 (their
  collectives). Then the run resumes from step 3 (step 5's checkpoint
  removed) and is compared with an uninterrupted run in the same cluster.
  """
  release, held = threading.Event(), []
  real = checkpoint.Checkpointer._hand_over

  def hand_over(self, step, state, meta):
    if step == 3 and jax.process_index() == held_host:
      held.append(release.wait(timeout=300))
    return real(self, step, state, meta)

  checkpoint.Checkpointer._hand_over = hand_over  # This host process only.

  def after(tr, metrics):
    del metrics
    if tr.step == 5:
      release.set()

  first = _trainer(directory)
  first.fit(until=5, on_step=after)
  first.close()
  multihost_utils.sync_global_devices("first run done")
  if jax.process_index() == 0:
    shutil.rmtree(os.path.join(directory, "5"))
  multihost_utils.sync_global_devices("checkpoint 5 removed")
  resumed = _trainer(directory)
  resumed_from = resumed.resumed_from
  resumed.fit(until=until)
  ref = _trainer(None)
  ref.fit(until=until)
  return {"held": held, "resumed_from": resumed_from,
          "digest": hetjax.params_digest(resumed.params()),
          "reference": hetjax.params_digest(ref.params())}
