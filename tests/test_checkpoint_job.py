"""A checkpoint continues only the job that wrote it: another global batch or seed is refused.

Another model or optimizer: tests/test_checkpoint.py. These two are what a
user changes on the command line and reruns in the same folder.
"""

import optax
import pytest

import hetjax
from hetjax import models as zoo
from hetjax import trainer
from hetjax.checkpoint import manager as checkpoint
from hetjax.input import data


def _trainer(directory, *, global_batch=64, seed=0) -> trainer.Trainer:
  hetjax.initialize()
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))
  return trainer.Trainer(task, optax.sgd(0.1), data.load("digits"),
                         trainer.TrainConfig(global_batch=global_batch, microbatch=4, seed=seed),
                         checkpoint=checkpoint.CheckpointConfig(str(directory), every=2))


def test_a_checkpoint_of_another_batch_or_seed_is_refused_saying_what_differs(tmp_path):
  first = _trainer(tmp_path)
  first.fit(until=2)
  first.close()
  with pytest.raises(ValueError, match=r"another job: .*global_batch: saved 64, now 32"):
    _trainer(tmp_path, global_batch=32)
  with pytest.raises(ValueError, match=r"another job: .*seed: saved 0, now 1"):
    _trainer(tmp_path, seed=1)
  assert _trainer(tmp_path).resumed_from == 2  # The same job continues.


def test_a_folder_that_cannot_be_created_is_refused_before_training():
  """Not only a path that is a file (tests/test_checkpoint.py): a folder the
  system refuses, here under /proc, where even root cannot write (a read-only
  folder would not do: the suite may run as root)."""
  with pytest.raises(ValueError, match=r"checkpoint folder /proc/self/hetjax-ckpt is not writable "
                                       r"\(.*\); choose another `directory`"):
    checkpoint.CheckpointConfig("/proc/self/hetjax-ckpt").validate()
