"""DESIGN.md invariant 2: uneven hosts reach the parameters of one device."""

import jax
import numpy as np
import pytest

from hetjax.testing import run_hosts

UNEVEN = (5, 23, 36)


def assert_same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def one_device():
  """1 host x 1 device: the reference for every model and backend."""
  return run_hosts("_cluster_entries:exactness_matrix", hosts=1, devices_per_host=1,
                   args=("equal",))[0]


@pytest.fixture(scope="module")
def three_uneven_hosts():
  """3 hosts x 2 devices with shares 5, 23, 36 of a global batch of 64."""
  return run_hosts("_cluster_entries:exactness_matrix", hosts=3, devices_per_host=2,
                   args=(UNEVEN,), timeout_s=600)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
@pytest.mark.parametrize("reduction", ["device", "host"])
def test_uneven_hosts_match_one_device(one_device, three_uneven_hosts, model, reduction):
  for host, result in enumerate(three_uneven_hosts):
    assert_same_params(result[(model, reduction)], one_device[(model, reduction)])


def test_training_moved_the_parameters(one_device, three_uneven_hosts):
  """Guards the test above against comparing two untrained models."""
  import hetjax_models  # noqa: F401
  params = three_uneven_hosts[0][("mlp", "device")]
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
  first = run_hosts("_cluster_entries:train_params", hosts=1, args=("mlp", "equal", "device", 1))[0]
  diffs = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(first[0]), jax.tree.leaves(params))]
  assert max(diffs) > 1e-3
