"""Per-step work must not grow with the number of parameter arrays.

A ResNet-50 has ~270 parameter and statistics arrays; per-leaf Python work in
the step (re-wrapping each leaf onto a mesh, one transfer per leaf) costs
~0.1 ms per leaf, which on a GPU is a large part of a step. This test counts,
per training step, the programs the runtime executes (compiled steps and
eager operations alike), the arrays stitched or re-wrapped and the
host-to-device transfers, for a model with 2 parameter arrays and one with
200: the counts must be equal.

Programs are counted from a JAX profiler trace (`jax.profiler`, host tracer
level 3 records every executable launch); wraps and transfers by counting,
for the duration of the count, hetjax's calls of the JAX functions that make them.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetjax
from hetjax.input import data

STEPS = 3
_KINDS = {"make_array_from_single_device_arrays": "wraps",
          "make_array_from_process_local_data": "wraps", "device_put": "transfers"}
_LAUNCH = "CommonPjRtLoadedExecutable::ExecutePrepare"  # One per program run on a device.


class _CountingJax:
  """The `jax` module as a caller sees it, counting the wraps and transfers it makes."""

  def __init__(self, real, counts: collections.Counter):
    self._real, self._counts = real, counts

  def __getattr__(self, name: str):
    real, kind = getattr(self._real, name), _KINDS.get(name)
    if kind is None:
      return real

    def run(*args, **kwargs):
      self._counts[kind] += 1
      return real(*args, **kwargs)
    return run


@contextlib.contextmanager
def counting():
  """Counts 'programs', 'wraps' and 'transfers' made inside the context.

  Wraps and transfers are counted where hetjax's modules (and this one) make
  them: their `jax` is a counting stand-in meanwhile; JAX itself is left
  alone. The program count is filled in when the context closes.
  """
  counts, real = collections.Counter(), sys.modules["jax"]
  callers = [module for name, module in list(sys.modules.items())
             if (name.startswith("hetjax") or name == __name__)
             and getattr(module, "jax", None) is real]
  for module in callers:
    module.jax = _CountingJax(real, counts)
  options = real.profiler.ProfileOptions()
  options.host_tracer_level = 3
  options.python_tracer_level = 0
  with tempfile.TemporaryDirectory(prefix="hetjax-dispatch-") as folder:
    real.profiler.start_trace(folder, profiler_options=options)
    try:
      yield counts
    finally:
      real.profiler.stop_trace()
      for module in callers:
        module.jax = real
    trace = real.profiler.ProfileData.from_file(
        glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)[0])
    counts["programs"] = sum(ev.name == _LAUNCH for plane in trace.planes
                             for line in plane.lines for ev in line.events)


def _task(num_leaves: int) -> hetjax.Task:
  """A linear model whose weights are split into `num_leaves` arrays."""
  width = 4

  def init(rng, batch):
    del batch
    # One draw, cut into leaves: a draw per leaf made XLA compile 200 PRNG
    # programs (23 s of the test at -O0); the leaves are the same 200 arrays.
    weights = 0.1 * jax.random.normal(rng, (num_leaves, width))
    return {f"w{i:03d}": weights[i] for i in range(num_leaves)}

  def loss(params, batch, rng):
    del rng
    w = sum(params.values())
    return (batch["x"] @ w - batch["y"]) ** 2, {}

  return hetjax.from_functions(init, loss)


def _source() -> data.ArraySource:
  rng = np.random.default_rng(0)
  return data.ArraySource({"x": rng.normal(size=(64, 4)).astype(np.float32),
                           "y": rng.normal(size=(64,)).astype(np.float32)})


def _per_step_counts(num_leaves: int, reduction: str) -> dict[str, float]:
  trainer = hetjax.Trainer(_task(num_leaves), optax.adam(1e-2), _source(),
                           hetjax.TrainConfig(global_batch=16, microbatch=8, reduction=reduction))
  for _ in range(2):  # Compilation and first transfers.
    trainer.train_step()
  trainer.mode.block_until_ready()  # Not `local_state`: the next step would copy what it lent.
  with counting() as counts:
    for _ in range(STEPS):
      trainer.train_step()
    jax.block_until_ready(trainer.mode.local_state)
  trainer.close()
  return {k: v / STEPS for k, v in counts.items()}


@pytest.mark.parametrize("reduction", ["device", "host"])
def test_per_step_dispatches_do_not_grow_with_the_leaf_count(reduction):
  few = _per_step_counts(2, reduction)
  many = _per_step_counts(200, reduction)
  assert few["programs"] >= 2  # Two micro-batches per step at least: the counter sees them.
  assert many == few, f"2 leaves: {few}; 200 leaves: {many}"


def test_the_counter_sees_per_leaf_work():
  """The counter itself: per-leaf eager ops, transfers and one jitted call."""
  tree = {f"w{i}": jnp.ones(3) for i in range(5)}
  jitted = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t))
  jax.block_until_ready((jitted(tree), jax.tree.map(lambda x: x + 1, tree)))
  with counting() as counts:
    jax.block_until_ready(jax.tree.map(lambda x: x + 1, tree))
    jax.block_until_ready(jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree))
    jax.block_until_ready(jitted(tree))
  assert counts == {"programs": 5 + 1, "transfers": 5}


def test_a_step_transfers_one_array_per_micro_batch_besides_the_models():
  """Positions, mask and host vector ride in the micro-batch's transfer.

  The batch here is {x, y}: with the position array, one batched transfer
  per micro-batch, and nothing made from host data. Re-wrapped per step:
  nothing in this one-device world, whose sums row is the total as it is
  (`Reduced.total`); on more devices, the sums onto the world mesh and the
  summed row back onto the local mesh.
  """
  counts = _per_step_counts(2, "device")
  assert counts["transfers"] == 2  # Two micro-batches of 8 per step.
  assert counts.get("wraps", 0) == 0
