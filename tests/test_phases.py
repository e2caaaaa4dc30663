"""The lifecycle's phases, as a listener sees them through a real Trainer."""

import optax
import pytest

import hetjax
from hetjax import phases


class Recorder:
  def __init__(self):
    self.events = []

  def phase_started(self, name, step, at):
    self.events.append(("start", name, step))

  def phase_ended(self, name, step, at, failed):
    self.events.append(("end", name, step, failed))


def test_a_fit_announces_build_training_evaluation_checkpoint_and_summary(tmp_path):
  task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(8,))
  source = hetjax.data.load("digits")
  with phases.PHASES.subscribe(Recorder()) as rec:
    trainer = hetjax.Trainer(task, optax.sgd(0.1), source,
                             hetjax.TrainConfig(global_batch=16, microbatch=8),
                             checkpoint=hetjax.CheckpointConfig(str(tmp_path), every=2))
    trainer.fit(steps=2, eval_source=source)
    trainer.close()
  started = [e[1] for e in rec.events if e[0] == "start"]
  # Restoring (an empty folder here) happens inside building, before the loop.
  assert started[:3] == [phases.BUILDING, phases.RESTORING, phases.TRAINING]
  assert {phases.EVALUATION, phases.CHECKPOINT, phases.AGREEMENT, phases.SUMMARY} <= set(started)
  # Every start has its end, innermost first, and nothing failed.
  stack = []
  for e in rec.events:
    if e[0] == "start":
      stack.append(e[1])
    else:
      assert stack.pop() == e[1] and e[3] is False
  assert not stack
  assert phases.PHASES.current is None


def test_a_failing_phase_is_reported_as_failed_and_left():
  with phases.PHASES.subscribe(Recorder()) as rec:
    with pytest.raises(RuntimeError):
      with phases.within(phases.EVALUATION, 3):
        assert phases.PHASES.current == phases.EVALUATION
        raise RuntimeError("boom")
  assert rec.events == [("start", "evaluation", 3), ("end", "evaluation", 3, True)]
  assert phases.PHASES.current is None


def test_an_unknown_phase_is_refused():
  with pytest.raises(ValueError, match="unknown phase 'eval'"):
    with phases.within("eval"):
      pass
