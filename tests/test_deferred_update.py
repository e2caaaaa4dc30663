"""A step's update runs in the next step's first program, or alone: the same bits.

The trainer applies step `s`'s update at the start of step `s + 1`'s first
local program; where nothing follows at once (a host with no micro-batch, a
checkpoint, a read of the state, the end of `fit`) it applies it alone with
the same function. Hosts may take either path for the same update, so both
must give the same parameters bit for bit; the learning rate each update
used must reach the records whichever path ran it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetjax
from hetjax.input import data


class BatchNormMlp(nn.Module):
  """Parameters, BatchNorm statistics (model state) and a mask, as real models have."""

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Dense(16)(x.reshape((x.shape[0], -1)))
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(
        x, mask=None if mask is None else mask[:, None] > 0)
    return nn.Dense(10)(nn.relu(x))


def _loss(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {}


SCHEDULE = optax.linear_schedule(0.1, 0.01, transition_steps=6)


def _trainer(microbatch: int, global_batch: int = 32) -> hetjax.Trainer:
  optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
  return hetjax.Trainer(hetjax.from_linen(BatchNormMlp(), _loss, mask_arg="mask"), optimizer,
                        data.load("digits"),
                        hetjax.TrainConfig(global_batch=global_batch, microbatch=microbatch,
                                           check_every=0))


def _count_updates_alone(trainer: hetjax.Trainer) -> list[int]:
  """Counts, on this trainer only, the updates applied alone (`LocalProgram.update`)."""
  calls, alone = [], trainer.mode.local.update

  def counted(*args, **kwargs):
    calls.append(int(trainer.step))
    return alone(*args, **kwargs)

  trainer.mode.local.update = counted
  return calls


def _state_bytes(trainer: hetjax.Trainer) -> list[bytes]:
  state = trainer.mode.local_state
  return [np.asarray(x.addressable_data(0)).tobytes() for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("microbatch", [32, 8, 12])  # One micro-batch; four; a partial block.
def test_updates_applied_alone_give_the_same_bits_as_updates_in_the_next_step(microbatch):
  fused, alone = _trainer(microbatch), _trainer(microbatch)
  fused_calls, alone_calls = _count_updates_alone(fused), _count_updates_alone(alone)
  fused.fit(6)  # Steps 1-5 apply their predecessor's update in their first program.
  # Reading the state after every step applies each update alone.
  alone.fit(6, on_step=lambda t, metrics: t.mode.local_state)
  # The two paths really ran: every update alone in one trainer; in the
  # other, none before the end (`fit` may settle the last one).
  assert len(alone_calls) == 6 and len(fused_calls) <= 1, (alone_calls, fused_calls)
  assert _state_bytes(fused) == _state_bytes(alone)
  assert int(fused.state.step) == int(alone.state.step) == 6
  # The model state moved (BatchNorm's running averages), so it was compared too.
  init = _trainer(microbatch)
  assert _state_bytes(init) != _state_bytes(fused)
  for t in (fused, alone, init):
    t.close()


def test_every_update_records_its_learning_rate_whichever_program_ran_it():
  overlapped, stepped = _trainer(8), _trainer(8)
  records = {"overlapped": [], "stepped": []}
  overlapped.fit(6, sinks=[records["overlapped"].append])
  # A callback finishes every step at once; reading the state then applies
  # each update alone.
  stepped.fit(6, sinks=[records["stepped"].append], on_step=lambda t, m: t.mode.local_state)
  expected = [pytest.approx(float(SCHEDULE(i)), rel=1e-6) for i in range(6)]
  for name, got in records.items():
    assert [r["step"] for r in got] == list(range(1, 7)), name
    assert [r["lr"] for r in got] == expected, name
  assert overlapped.mode.learning_rate() == pytest.approx(float(SCHEDULE(5)), rel=1e-6)
  for t in (overlapped, stepped):
    t.close()


def test_the_state_has_every_dispatched_update_and_can_be_replaced():
  trainer = _trainer(8)
  first = np.asarray(jax.tree.leaves(trainer.state.params)[0].addressable_data(0))
  trainer.train_step()
  trainer.train_step()
  state = trainer.state  # Applies step 1's update, which waited for a next step.
  assert int(state.step) == 2 and trainer.state is state  # Re-wrapped once, then reused.
  assert jax.tree.leaves(state.params)[0].sharding == trainer.meshes.replicated
  saved = jax.tree.map(jnp.copy, state)  # The next step donates the state's buffers.
  trainer.train_step()
  trainer.state = saved  # Step 2's pending update belongs to the state replaced: dropped.
  assert int(trainer.state.step) == 2
  trainer.train_step()
  assert int(trainer.state.step) == 3
  moved = np.asarray(jax.tree.leaves(trainer.state.params)[0].addressable_data(0))
  assert not np.array_equal(moved, first)
  trainer.close()


def test_a_state_read_between_steps_stays_valid_after_later_steps():
  """Later steps donate a copy of what `state`, `local_state` or the setter lent, not it."""
  trainer = _trainer(8)
  trainer.fit(2)
  held, held_local = trainer.state, trainer.mode.local_state
  # Copies, not `device_get`: on CPU its zero-copy views would keep the
  # runtime from donating the buffers at all, and the test from failing.
  host_copy = lambda tree: jax.tree.map(lambda x: np.array(x, copy=True), tree)
  before = host_copy(held.params)
  trainer.fit(2)
  assert not any(x.is_deleted() for x in jax.tree.leaves((held, held_local)))
  assert jax.tree.all(jax.tree.map(np.array_equal, host_copy(held.params), before))
  assert jax.tree.all(jax.tree.map(np.array_equal, host_copy(held_local.params), before))
  moved = host_copy(trainer.state.params)
  assert not jax.tree.all(jax.tree.map(np.array_equal, moved, before))  # It trained on.

  given = jax.tree.map(jnp.copy, trainer.state)
  trainer.state = given
  trainer.fit(1)
  assert not any(x.is_deleted() for x in jax.tree.leaves(given))
  assert jax.tree.all(jax.tree.map(np.array_equal, host_copy(given.params), moved))


def test_steps_that_nobody_read_between_donate_the_state_without_a_copy():
  """The copy is paid only after a read: a plain `fit` donates the live state."""
  trainer = _trainer(8)
  trainer.fit(2)
  trainer.mode.block_until_ready()  # Waits without lending the state.
  live = trainer.mode.replica.live
  trainer.fit(1)
  assert all(x.is_deleted() for x in jax.tree.leaves(live.params))
