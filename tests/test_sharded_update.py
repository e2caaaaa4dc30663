"""The sharded update: each slice of the state updated once, then gathered.

1. Hosts whose compilers differ (host 0 with XLA's default passes, host 1 at
   `--xla_backend_optimization_level=0`, standing in for another GPU
   generation; emulation) train adam with a clipped global norm for 50
   steps, checking agreement every 25: with per-host updates the first
   check failed (step 50, measured when checks came every 50; adam with
   the clip alone, fed the same gradients on both hosts, gives other bits
   from step 1); now every check passes and the final parameters are
   bit-identical. Both reduction backends. The negative control: the same
   training as a plain `jax.jit` loop on each host alone ends with
   parameters that differ between the hosts, in 43 % of their elements
   at step 50 (24 % at 10, 52 % at 300). The steps cost little: 300
   steps took 56 CPU-s, 50 take 49; compiling is the rest.
2. 1 host x 1 device (the fused update) and 3 hosts x 2 devices (sharded,
   device backend; an uneven, then a balanced split, device batches 4, 2,
   1) reach an independent oracle (plain `jax.grad` +
   optax on the whole global batch, cut into blocks padded with junk),
   parameters and BatchNorm state; a checkpoint written on 3x2 resumes on 2x1 (sharded
   over the host backend's CPU mesh) and still matches the oracle. The 1x1
   and 3x2 runs and the oracle are tests/test_exactness.py's (the same
   models, batch, blocks and splits; conftest.py's session fixtures
   and `cached_oracle` run each once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _exact_entries as ex
import _sharded_entries as ent
from test_exactness import RESUMED_END, assert_close, cached_oracle
from hetjax.step import sharding
from hetjax.testing import run_hosts

FIRST, SECOND = ex.STEPS, RESUMED_END  # Steps on 3x2 (and 1x1), then the 2x1 run's resumed end.
# Host 0 compiles with XLA's default passes (the suite's conftest asks for
# cheap ones), host 1 at -O0: the measurement.
MIXED = {0: {"XLA_FLAGS": ""}, 1: {"XLA_FLAGS": "--xla_backend_optimization_level=0"}}


def test_hosts_compiled_differently_keep_identical_replicas():
  """Sync on both backends (50 steps, checks every 25); hybrid's and elastic's centres."""
  hosts = run_hosts("_sharded_entries:mixed_compilers_all", hosts=2, args=(50, 25, 25),
                    host_env=MIXED, timeout_s=900)
  # The negative control: updating its own replica, each host ends elsewhere, in
  # many elements (43 % measured), not one stray bit.
  (_, control0), (_, control1) = hosts
  differ = [np.asarray(a) != np.asarray(b) for a, b in zip(jax.tree.leaves(control0),
                                                           jax.tree.leaves(control1), strict=True)]
  share = sum(d.sum() for d in differ) / sum(d.size for d in differ)
  assert share > 0.1, share
  results = [runs for runs, _ in hosts]
  runs = list(ent.BACKENDS) + [f"{mode} ({backend})" for mode, backend in ent.ROUND_MODES]
  assert len(results[0]) == len(runs)
  for run, (host0, host1) in zip(runs, zip(*results)):
    assert host0[0] is None and host1[0] is None, f"{run}: a check failed"
    for a, b in zip(jax.tree.leaves(host0[1]), jax.tree.leaves(host1[1]), strict=True):
      assert np.array_equal(a, b), f"{run}: the hosts' parameters differ"


@pytest.fixture(scope="module")
def runs(exact_one_device, exact_clusters):
  """1x1 (host backend) and 3x2 (device backend) to step FIRST: the exactness matrix's runs
  (the 3x2 one saved its checkpoints); 2x1 (host backend) resumed from those to SECOND.

  Each is {model: (params, model state, shares or the step resumed from, (optimizer bytes
  held per device, unsplit, the summary's memory figure))}.
  """
  (clusters, folder), backend = exact_clusters, "device"
  assert all(ex.CLUSTER_REDUCTION[model] == backend for model in ent.MODELS)
  assert set(ent.MODELS) <= set(ex.SAVED)
  of_backend = lambda results: {model: results[(model, backend)] for model in ent.MODELS}
  narrow = run_hosts("_sharded_entries:train_and_save", hosts=2, devices_per_host=1,
                     args=(SECOND, "host", "equal", folder, True), timeout_s=900)
  one = {model: exact_one_device[(model, ex.ONE_DEVICE_REDUCTION[model])] for model in ent.MODELS}
  return one, [of_backend(host) for host in clusters], narrow


@pytest.mark.parametrize("model", ent.MODELS)
def test_every_layout_and_a_resumed_checkpoint_match_the_oracle(model, runs):
  one, wide, narrow = runs
  snapshots = cached_oracle(model)
  first, second = snapshots[FIRST], snapshots[SECOND]
  assert_close(one[model][0], first[0], f"1x1 {model} params")
  assert_close(one[model][1], first[1], f"1x1 {model} state")
  for host, result in enumerate(wide):
    assert_close(result[model][0], first[0], f"3x2 host {host} {model} params")
    assert_close(result[model][1], first[1], f"3x2 host {host} {model} state")
  for host, result in enumerate(narrow):
    assert result[model][2] == FIRST  # Resumed from the 3x2 checkpoint.
    assert_close(result[model][0], second[0], f"2x1 host {host} {model} params (resumed)")
    assert_close(result[model][1], second[1], f"2x1 host {host} {model} state (resumed)")


def test_the_optimizer_state_is_split_over_every_device(runs):
  """adam's moments (the transformer) take about a sixth of their bytes per device on 3x2,
  half on 2x1 (the host backend splits over one CPU device per host)."""
  one, wide, narrow = runs
  held, whole, figure = one["transformer"][3]
  assert held == whole
  for results, ways in ((wide, 6), (narrow, 2)):
    held, whole, figure = results[0]["transformer"][3]  # The figure: from the arrays' sizes.
    assert whole == one["transformer"][3][1]
    assert held < whole / ways * 1.05, (held, whole, ways)
    assert figure["split_over"] == ways and figure["unsplit"]["opt_state"] == whole
    assert figure["split"]["opt_state"] == held
  assert one["transformer"][3][2]["split_over"] == 1 and "split" not in one["transformer"][3][2]


def test_a_factored_optimizer_is_refused_under_the_sliced_layout_only():
  """Asked for slices, adafactor is refused before anything compiles, naming why and
  what to do; left to choose, it gets whole leaves."""
  from hetjax.step import optimizer_layout
  params = {"w": jax.ShapeDtypeStruct((6, 4), jnp.float32)}
  opt = optax.adafactor(1e-3, min_dim_size_to_factor=2)
  like = jax.eval_shape(opt.init, params)
  with pytest.raises(ValueError, match="not element-wise.*'auto' or 'whole'"):
    optimizer_layout.choose(opt, params, like, 2, "sliced")
  assert optimizer_layout.choose(opt, params, like, 2).layout == "whole"


def test_split_and_join_round_trip():
  x = jnp.arange(7.0).reshape(7, 1)
  split = sharding.split_leaf(x, 3)
  assert split.shape == (3, 3) and float(split[2, 2]) == 0.0  # Zero-padded.
  np.testing.assert_array_equal(sharding.join_leaf(split, (7, 1)), x)


def test_the_sharded_update_makes_three_collectives_whatever_the_leaves_and_follows_the_rule():
  """One reduce-scatter of the laid-out sums, one small all-gather (scalars and host
  vectors), one all-gather of the new slices: 3 or 12 leaves alike (GSPMD's own
  split made 24 for the digits mlp). The result is the rule's, written with optax and
  numpy alone, on rows whose weights and counts differ from device to device; fp16
  skips the update and halves the scale when one device's sum is infinite; the whole
  layout (adafactor) adds the gathers of what the slices hold (4 devices)."""
  results = run_hosts("_sharded_entries:reduction_program", hosts=1, devices_per_host=4,
                      timeout_s=300)[0]
  for case, (counts, diff, scale, want_scale, layout) in zip(ent.CASES, results, strict=True):
    name, _, _, precision, overflow = case
    if layout == "sliced":
      # fp16 adds one tiny all-reduce: whether any device's summed slice overflowed.
      extra = {"all-reduce": 1} if precision == "fp16" else {}
      assert counts == {"reduce-scatter": 1, "all-gather": 2, **extra}, (name, counts)
    else:  # Plus what the slices hold, gathered per dtype (float32; int32 for the counts).
      assert counts == {"reduce-scatter": 1, "all-gather": 4}, (name, counts)
    assert diff < 1e-5, (name, diff)
    if precision == "fp16":
      assert scale == want_scale == (2.0 ** 14 if overflow else 2.0 ** 15), (name, scale)
