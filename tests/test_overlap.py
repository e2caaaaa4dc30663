"""`fit` overlaps steps: no wait for the devices on the critical path.

A step's statistics and host rows are fetched only after the next step's
local programs (and their micro-batches) are on the devices, so the devices
never idle while Python prepares a step. Overlapping must change nothing a
user can observe: the same parameters, the same per-step records, and the
balancer seeing the same figures at the same step whether or not a loop
overlaps (invariant 3: hosts may overlap differently, e.g. when only host 0
has an `on_step` callback).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import hetjax
from hetjax.input import data
from hetjax import step as step_lib


def _task() -> hetjax.Task:
  def init(rng, batch):
    del batch
    return {"w": 0.1 * jax.random.normal(rng, (4,)), "b": jax.numpy.zeros(())}

  def loss(params, batch, rng):
    del rng
    return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2, {}

  return hetjax.from_functions(init, loss)


def _source() -> data.ArraySource:
  rng = np.random.default_rng(0)
  return data.ArraySource({"x": rng.normal(size=(64, 4)).astype(np.float32),
                           "y": rng.normal(size=(64,)).astype(np.float32)})


class RecordingBalancer:
  """Equal shares; records what it was told, and when it was asked."""

  name = "recording"

  def __init__(self):
    self.events: list[tuple] = []

  def shares(self, step: int) -> tuple[int, ...]:
    self.events.append(("shares", step))
    return (16,)

  def observe(self, step, shares, compute_s) -> None:
    self.events.append(("observe", step, tuple(shares), len(compute_s)))


def _trainer(balancer=None) -> hetjax.Trainer:
  return hetjax.Trainer(_task(), optax.adam(1e-2), _source(),
                        hetjax.TrainConfig(global_batch=16, microbatch=8, check_every=0),
                        balancer=balancer)


def test_fit_fetches_a_step_only_after_dispatching_the_next(monkeypatch):
  order: list[str] = []
  real_local, real_fetch = step_lib.LocalProgram.__call__, step_lib.Reduced.fetch

  def local(self, *args, **kwargs):
    order.append(f"local {args[5]}")  # The step index.
    return real_local(self, *args, **kwargs)

  def fetch(self):
    order.append("fetch")
    return real_fetch(self)

  monkeypatch.setattr(step_lib.LocalProgram, "__call__", local)
  monkeypatch.setattr(step_lib.Reduced, "fetch", fetch)
  trainer = _trainer()
  trainer.fit(4)
  trainer.close()
  # Each fetch (of step s) comes after step s + 1's local programs; the last
  # step is fetched at the end of the run.
  assert order == ["local 0", "local 1", "fetch", "local 2", "fetch", "local 3", "fetch", "fetch"]


def test_overlapping_changes_no_parameter_record_or_balancer_decision():
  overlapped_balancer, stepped_balancer = RecordingBalancer(), RecordingBalancer()
  overlapped = _trainer(overlapped_balancer)
  summary = overlapped.fit(7)
  stepped = _trainer(stepped_balancer)
  seen = []
  stepped.fit(7, on_step=lambda t, m: seen.append(m))  # A callback: every step is finished at once.
  assert len(seen) == 7
  np.testing.assert_array_equal(hetjax.params_digest(overlapped.params()),
                                hetjax.params_digest(stepped.params()))
  assert overlapped.history.loss == stepped.history.loss
  assert overlapped.history.shares == stepped.history.shares
  # Step s is decided after exactly the figures of steps <= s - 4 (carried by
  # the rows of step s - 2), in both loops.
  assert overlapped_balancer.events == stepped_balancer.events
  observed = [e[1] for e in overlapped_balancer.events if e[0] == "observe"]
  assert observed == [0, 1, 2]
  asked = [e for e in overlapped_balancer.events]
  assert asked.index(("observe", 0, (16,), 1)) == asked.index(("shares", 4)) - 1
  # Every step's compute and wait seconds reach the history, the last two by summary().
  assert len(summary["per_host"][0]["compute_s"]) == 7
  assert len(summary["per_host"][0]["wait_s"]) == 7
  assert all(c >= 0 for c in summary["per_host"][0]["compute_s"])
  overlapped.close()
  stepped.close()


def test_train_step_still_returns_its_own_steps_metrics():
  a, b = _trainer(), _trainer()
  first = [a.train_step() for _ in range(3)]
  b.fit(3)
  assert [m["loss"] for m in first] == b.history.loss
  assert a.step == b.step == 3
  a.close()
  b.close()
