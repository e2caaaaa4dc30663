"""Balancing changes the speed, never the math, for the optimizer a user brings.

The field's optimizers (masks and labels by ndim, adafactor's factored
statistics, Muon's orthogonalised matrices, lion, lamb, a clipped nesterov
sgd, `optax.MultiSteps`, schedule-free adamw) and a transformation written
here whose update depends on leaf shapes train a user's Flax model on
1 host x 1 device and on 3 uneven hosts x 2 devices; on 3x2 the
optimizers alternate between the two reduction backends, so each backend
meets sliced and whole layouts (a backend only moves rows; the layout is
the sharded update's). Each run must reach the parameters of the oracle below, which
shares no code with hetjax: optax on the full batch with `model.apply`.
On 3x2 the sharded update splits every leaf six ways, where a mask by ndim
would see matrices everywhere and adafactor would factor the slices; every
host must also hold the same bits (agreement checks, and the final
parameters compared).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest

import _zoo_entries as zoo
from hetjax.testing import run_hosts

RTOL, ATOL = 1e-4, 1e-5
REDUCTIONS = ("device", "host")
NAMES = list(zoo.OPTIMIZERS)
WIDE_PLAN = tuple((name, REDUCTIONS[i % 2]) for i, name in enumerate(NAMES))
# Whole leaves for what the sliced layout cannot compute alike: factored or
# matrix-wise state, and the user's shape-dependent scaling.
WHOLE = {"adafactor", "muon", "user's fan-in scaling"}


def oracle(name: str):
  """Parameters after `zoo.STEPS` full-batch steps of plain optax."""
  data = zoo.arrays()
  optimizer = zoo.OPTIMIZERS[name]()
  params = zoo.initial_params()
  state = optimizer.init(params)

  def loss(params):
    logits = zoo.Net().apply({"params": params}, data["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]).mean()

  @jax.jit
  def step(params, state):
    updates, state = optimizer.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  for _ in range(zoo.STEPS):
    params, state = step(params, state)
  return jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def runs():
  """(1x1 results, [3x2 results per host]); the 1x1 run trains beside the cluster."""
  one = {}
  thread = threading.Thread(target=lambda: one.update(run_hosts(
      "_zoo_entries:train_zoo", hosts=1, args=(tuple((name, "device") for name in NAMES),
                                               "equal"), timeout_s=900)[0]))
  thread.start()
  try:
    wide = run_hosts("_zoo_entries:train_zoo", hosts=3, devices_per_host=2,
                     args=(WIDE_PLAN, zoo.UNEVEN), timeout_s=900)
  finally:
    thread.join()
  return one, wide


@pytest.mark.parametrize("name", list(zoo.OPTIMIZERS))
def test_every_layout_reaches_the_full_batch_oracle(name, runs):
  one, wide = runs
  expected = oracle(name)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), expected,
                                       zoo.initial_params()))
  assert max(moved) > 1e-3, f"{name}: the oracle did not train"  # The comparison means something.
  reduction = dict(WIDE_PLAN)[name]
  results = [("1x1", one[(name, "device")])] + [
      (f"3x2 ({reduction}) host {h}", host[(name, reduction)]) for h, host in enumerate(wide)]
  for where, (params, _) in results:
    for path, got in jax.tree_util.tree_flatten_with_path(params)[0]:
      want = expected
      for key in path:
        want = want[key.key]
      np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL,
                                 err_msg=f"{name} on {where}: {jax.tree_util.keystr(path)}")


def test_every_host_holds_the_same_bits_and_the_layout_fits_the_optimizer(runs):
  _, wide = runs
  assert {r for _, r in WIDE_PLAN} == set(REDUCTIONS)
  for key in WIDE_PLAN:
    first, layout = wide[0][key]
    assert layout == ("whole" if key[0] in WHOLE else "sliced"), (key, layout)
    for host in wide[1:]:
      for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(host[key][0]), strict=True):
        assert np.array_equal(a, b), f"{key}: the hosts' parameters differ"
