"""The simulator's micro-batch price and per-host device batches (pure numpy, SIMULATED)."""

import dataclasses
import importlib.util
import pathlib

import numpy as np
import pytest

from hetjax.sim import price
from hetjax.sim import sync as sim

BASE = sim.ClusterSpec(sim.mix(16), devices_per_host=8, per_host_batch=512, price=True,
                       straggler_rate=0.0, persistent_fraction=0.0)


def test_the_curve_saturates_and_reads_the_training_level_at_the_reference_batch():
  thr = price.device_samples_per_s(2500.0, np.array([1, 8, 64, 256, 4096]))
  assert thr[3] == pytest.approx(2500.0)
  assert (np.diff(thr) > 0).all() and thr[1] < 0.45 * thr[-1] and thr[-1] < 1.05 * thr[3]


def test_unpriced_k1_costs_are_the_costs_before_device_batches():
  plain = sim.ClusterSpec(sim.mix(8))
  again = dataclasses.replace(plain, device_batches=(1,) * 8)
  shares = np.array([64, 128, 200, 0, 512, 640, 1, 64])
  np.testing.assert_allclose(again.costs(0).predict(shares), plain.costs(0).predict(shares))
  assert plain.ladders() is None


def test_auto_takes_the_largest_device_batch_that_fits_each_gpu():
  ks = sim.auto_device_batches(dataclasses.replace(BASE, microbatch=8))
  assert dict(zip(BASE.gpus, ks)) == {"H100": 64, "A100": 32, "V100": 16}
  with pytest.raises(ValueError, match="does not fit"):
    sim.auto_device_batches(dataclasses.replace(BASE, microbatch=512))


def test_priced_small_micro_batches_cost_more_and_big_programs_less():
  m8 = dataclasses.replace(BASE, microbatch=8)
  auto = dataclasses.replace(m8, device_batches=sim.auto_device_batches(m8))
  shares = np.full(16, 512)
  assert (auto.costs().predict(shares) < 0.7 * m8.costs().predict(shares)).all()


def test_the_device_batch_figure_meets_issue_27():
  spec = importlib.util.spec_from_file_location(
      "simulate_bench", pathlib.Path(__file__).parents[1] / "bench" / "simulate.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  out = bench.device_batch_table(80, (0,))  # The bench default length; seed 0 is its worst of 5.
  assert out["ratio"] >= 1.10, out["ratio"]
  assert 0.5 < out["fraction_of_ideal"] < 1.0
  rates = out["rates"]
  assert rates["m=8, k=auto"]["dynamic"] > max(r["dynamic"] for n, r in rates.items() if n != "m=8, k=auto")


def test_sharding_within_a_host_prices_three_collectives_of_its_parameters_per_program_run():
  """A sharded host's every program run adds its forward gather, backward re-gather and
  reduce-scatter of the parameter bytes over its link; hosts that do not shard cost the same."""
  plain = sim.ClusterSpec(sim.mix(4), straggler_rate=0.0, persistent_fraction=0.0)
  on = (False, True, False, True)
  d, link = plain.devices_per_host, 100e9
  term = 3 * (d - 1) / d * plain.param_bytes / link
  shares = np.array([512, 512, 0, 256])
  runs = shares / plain.granularity  # One program run per round of microbatch x devices.
  for price_on in (False, True):
    base = dataclasses.replace(plain, price=price_on)
    sharded = dataclasses.replace(base, shard_within_host=on, intra_host_bandwidth=link)
    grown = sharded.costs().predict(shares) - base.costs().predict(shares)
    np.testing.assert_allclose(grown, np.where(on, runs * term, 0.0), rtol=1e-9, atol=1e-15)
    off = dataclasses.replace(base, shard_within_host=(False,) * 4, intra_host_bandwidth=link)
    assert np.array_equal(off.costs().predict(shares), base.costs().predict(shares))
  nvlink = dataclasses.replace(plain, shard_within_host=on)  # The default link: the host's NVLink.
  assert nvlink.within_host_s(1) == pytest.approx(3 * (d - 1) / d * plain.param_bytes / 300e9)
  with pytest.raises(ValueError, match="one value per host"):
    dataclasses.replace(plain, shard_within_host=(True,))
