"""Sharding within a host (`hetjax.step.within_host`): the same math, less memory per device.

The exactness matrix's cluster of 3 hosts x 2 devices (ResNet-10, a
transformer with dropout, linen and NNX models with BatchNorm and Dropout;
an uneven, then a balanced split; device batches 4, 2, 1) shards on host 2
only: every host holds the same bits, and they match one device up to
float reduction order; so do a scanned decoder's (`nn.scan(nn.remat(...))`)
hosts with device batches of 4, and an NNX decoder's (`nnx.vmap` +
`nnx.scan`) sharded host of 4 devices. One host of 4 devices compiles
decoders stacked four ways with and without sharding and compares XLA's
per-device step peak bytes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import _exact_entries as ex
import _within_host_entries as entries
from hetjax import config as config_lib
from hetjax.step import within_host
from hetjax.testing import run_hosts


def test_config_refuses_unknown_modes_and_wrong_counts():
  with pytest.raises(ValueError, match="shard_within_host"):
    config_lib.TrainConfig(global_batch=8, shard_within_host="sometimes").validate()
  with pytest.raises(ValueError, match="2 values for 3 hosts"):
    config_lib.TrainConfig(global_batch=8, shard_within_host="on,off").validate(num_hosts=3)
  with pytest.raises(ValueError, match="device_memory"):
    config_lib.TrainConfig(global_batch=8, device_memory=0).validate()
  config_lib.TrainConfig(global_batch=8, shard_within_host="off,off,on").validate(num_hosts=3)


def test_auto_shards_only_when_the_whole_state_does_not_fit():
  gb = 10**9
  assert not within_host.decide("auto", 4, 2 * gb, gb, 16 * gb, True, 0.8).on
  tight = within_host.decide("auto", 4, 20 * gb, 8 * gb, 16 * gb, True, 0.8)
  assert tight.on and "emulated" in tight.reason and "fits" in tight.reason
  assert not within_host.decide("auto", 4, 20 * gb, 8 * gb, None, False, 0.8).on
  assert not within_host.decide("on", 1, None, None, None, False, 0.8).on  # one device
  assert within_host.mode_of("off,off,on", 2) == "on"


def test_sharding_on_one_host_keeps_the_math_and_the_replicas(exact_one_device, exact_clusters):
  """The exactness matrix's 3x2 runs shard on host 2 only (`_exact_entries.SHARD_WITHIN_HOST`):
  every host holds the same bits, and they match one device up to float reduction order
  (tests/test_exactness.py compares them with its oracle too)."""
  for model, reduction in exact_clusters[0][0]:
    hosts = [host[(model, reduction)] for host in exact_clusters[0]]
    assert [host.sharded_within_host for host in hosts] == [False, False, True], model
    reference = jax.tree.leaves((hosts[0].params, hosts[0].model_state))
    for host in hosts[1:]:  # Bit-identical replicas: each slice from its one owner.
      assert all(np.array_equal(a, b) for a, b in zip(reference, jax.tree.leaves(
          (host.params, host.model_state)), strict=True)), model
    alone = exact_one_device[(model, ex.ONE_DEVICE_REDUCTION[model])]
    assert not alone.sharded_within_host
    for a, b in zip(reference, jax.tree.leaves((alone.params, alone.model_state)), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=model)


def test_a_sharded_hosts_checkpoint_resumes_on_one_device_and_continues_the_run(tmp_path):
  """Saved whole by 1 host x 2 devices with sharding on, resumed on 1 device without."""
  folder = str(tmp_path / "ckpt")
  (saved,) = run_hosts("_within_host_entries:train_saving", hosts=1, devices_per_host=2,
                       args=(folder, "on", 2), timeout_s=600)
  assert saved[0] is None and saved[2]  # A fresh run, sharded.
  resumed_from, resumed, sharded = entries.train_saving(folder, "off", 4)
  assert resumed_from == 2 and not sharded
  _, uninterrupted, _ = entries.train_saving(str(tmp_path / "reference"), "off", 4)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("structure,device_batch",
                         [("scan", 1), ("loop", 1), ("jit", 4), ("nnx", 1)])
def test_sharding_cuts_the_steps_peak_bytes(structure, device_batch):
  """1 host x 4 devices: a device's step peak with sharding at most 0.6 of without, for
  layers stacked with `nn.scan(nn.remat(...))`, in a Python loop, a jitted loss, and NNX
  layers stacked with `nnx.vmap` and run with `nnx.scan`."""
  (peaks,) = run_hosts("_within_host_entries:peaks", hosts=1, devices_per_host=4,
                       args=(structure, device_batch), timeout_s=600)
  assert peaks["on"] <= 0.6 * peaks["off"], peaks
  if structure == "scan":
    small, large = peaks["auto 0.001 GB"], peaks["auto 1000 GB"]
    assert small.on and "emulated" in small.reason, small
    assert not large.on and "emulated" in large.reason, large


def test_a_scanned_model_sharded_with_device_batches_keeps_the_math_and_the_replicas():
  """2 hosts x 2 devices, host 0 sharding with device batches of 4, host 1 whole with 2:
  bit-identical replicas, and one device's parameters up to float order."""
  hosts = run_hosts("_within_host_entries:scanned", hosts=2, devices_per_host=2,
                    args=("on,off", (4, 2)), timeout_s=600)
  assert [host[1] for host in hosts] == [True, False]
  peaks = hosts[0][2]  # Every host's, gathered: the sharded one below its unsharded figure.
  assert peaks == hosts[1][2] and peaks[0]["bytes"] < peaks[0]["unsharded"], peaks
  assert peaks[1]["bytes"] == peaks[1]["unsharded"], peaks
  for memory in (hosts[0][3], hosts[1][3]):  # Split bytes never exceed the unsplit ones.
    assert all(memory["split"][k] <= memory["unsplit"][k] for k in memory["unsplit"]), memory
    assert memory["step_peak"] in peaks
  assert [host[4] for host in hosts] == peaks
  (alone,) = run_hosts("_within_host_entries:scanned", hosts=1, devices_per_host=1,
                       args=("off", 1), timeout_s=600)
  reference = jax.tree.leaves(hosts[0][0])
  assert all(np.array_equal(a, b) for a, b in zip(reference, jax.tree.leaves(hosts[1][0]),
                                                   strict=True))
  for a, b in zip(reference, jax.tree.leaves(alone[0]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_sharded_nnx_stacked_model_keeps_the_math():
  """1 host x 4 devices sharding the NNX decoder (`nnx.vmap` + `nnx.scan`, each layer
  gathering its own parameters; the tied output reads the embedding outside `Embed`'s
  methods) against one device: the same parameters up to float order."""
  (sharded,) = run_hosts("_within_host_entries:scanned", hosts=1, devices_per_host=4,
                         args=("on", 1, 3, "nnx-read"), timeout_s=600)
  (alone,) = run_hosts("_within_host_entries:scanned", hosts=1, devices_per_host=1,
                       args=("off", 1, 3, "nnx-read"), timeout_s=600)
  assert sharded[1] and not alone[1]
  assert sharded[2][0]["bytes"] < sharded[2][0]["unsharded"], sharded[2]
  for a, b in zip(jax.tree.leaves(sharded[0]), jax.tree.leaves(alone[0]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", ["on", "auto", ("off", "on")])
def test_the_rounds_modes_refuse_sharding_within_a_host_before_compiling(value):
  """Hybrid and elastic hold whole parameters on every device: refused, never ignored."""
  from hetjax.config import RoundsConfig
  with pytest.raises(ValueError, match="`shard_within_host` .* applies to the sync mode only"):
    RoundsConfig(mode="hybrid").check_split(None, "equal", value)
  RoundsConfig(mode="elastic").check_split(None, "equal", "off")  # The default passes.


def test_the_command_line_refuses_it_for_a_rounds_mode(capsys, tmp_path):
  from hetjax import cli
  (tmp_path / "run.yaml").write_text("shard-within-host: on\n")  # A config-file key.
  assert cli.main(["train", "--mode", "hybrid", "--config", str(tmp_path / "run.yaml")]) == 2
  assert "--shard-within-host 'on' applies to the sync mode only" in capsys.readouterr().err
