"""Behavioural checks of the simulated cluster (pure numpy, fast)."""

import dataclasses

import numpy as np
import pytest

from hetjax.sim import sync as sim

QUIET = dict(noise=0.01, straggler_rate=0.0, persistent_fraction=0.0)


def _rate(spec, mode, steps=40, seed=0):
  return sim.simulate(spec, sim.make(mode, spec), steps, seed=seed).samples_per_s


def test_ring_allreduce_cost():
  assert sim.ring_allreduce_s(1, 1e8, 1e9, 1e-5) == 0.0
  assert sim.ring_allreduce_s(4, 1e8, 1e9, 1e-5) == pytest.approx(6 * 1e-5 + 1.5 * 0.1)


def test_tree_latency_grows_with_log_n_and_auto_picks_the_faster():
  assert sim.tree_allreduce_s(1024, 0.0, 1e9, 1e-5) == pytest.approx(20 * 1e-5)
  assert sim.ring_allreduce_s(1024, 0.0, 1e9, 1e-5) == pytest.approx(2046 * 1e-5)
  big = sim.ClusterSpec(sim.mix(1024))
  ring = sim.ClusterSpec(sim.mix(1024), algorithm="ring").comm_s()
  tree = sim.ClusterSpec(sim.mix(1024), algorithm="tree").comm_s()
  assert big.comm_s() == pytest.approx(min(ring, tree)) and tree < ring
  with pytest.raises(ValueError, match="algorithm"):
    sim.ClusterSpec(sim.mix(4), algorithm="mesh").comm_s()


def test_hierarchical_allreduce_adds_the_slowest_hosts_nvlink_twice():
  m, d = 1e8, 4
  nvlink_v100 = sim.NVLINK_BYTES_PER_S["V100"]
  intra = (d - 1) / d * m / nvlink_v100 + (d - 1) * 2e-6
  got = sim.hierarchical_allreduce_s(("H100", "V100"), d, m, 25e9, 1e-5, algorithm="ring")
  assert got == pytest.approx(2 * intra + sim.ring_allreduce_s(2, m, 25e9, 1e-5))
  assert sim.hierarchical_allreduce_s(("H100",), 1, m, 25e9, 1e-5) == 0.0


def test_fixed_cost_differs_by_gpu_class_and_persistent_hosts_are_slower():
  spec = sim.ClusterSpec(("H100", "V100"))
  fixed = spec.fixed_s()
  assert spec.host_overhead_s < fixed[0] < fixed[1]  # V100's slower memory updates slower.
  many = sim.ClusterSpec(sim.mix(1000), persistent_fraction=0.1)
  factor = many.persistent(seed=1)
  assert 50 < int((factor > 1).sum()) < 150 and set(np.unique(factor)) == {1.0, 1.3}
  assert np.array_equal(many.costs(1).per_sample_s, many.costs().per_sample_s * factor)


def test_slow_spells_have_random_lengths_with_the_given_mean():
  spec = sim.ClusterSpec(sim.mix(2000), straggler_rate=0.002, straggler_steps=10)
  spell = sim.spell_factors(spec, 400, seed=0) > 1.0
  began = spell & ~np.vstack([np.zeros((1, 2000), bool), spell[:-1]])
  lengths = spell.sum() / began.sum()  # Mean length (a few spells run past the end).
  assert 8.0 < lengths < 11.0
  assert 0.0015 < began.mean() < 0.0025


def test_grouped_spells_slow_whole_racks_as_often_per_host():
  spec = sim.ClusterSpec(sim.mix(2000), straggler_rate=0.002, straggler_steps=10, spell_group=8)
  spell = sim.spell_factors(spec, 400, seed=0) > 1.0
  racks = spell[:, :2000].reshape(400, 250, 8)
  assert (racks == racks[:, :, :1]).all()  # A rack is slow or fast as a whole.
  alone = sim.spell_factors(sim.ClusterSpec(sim.mix(2000), straggler_rate=0.002,
                                            straggler_steps=10), 400, seed=0) > 1.0
  assert 0.7 < spell.mean() / alone.mean() < 1.3  # The same slowed host-steps on average.


def test_unknown_gpu_class_is_refused():
  with pytest.raises(ValueError, match="unknown GPU class"):
    sim.ClusterSpec(("H100", "B200"))


def test_homogeneous_cluster_equal_matches_static():
  spec = sim.ClusterSpec(("A100",) * 8, **QUIET)
  assert _rate(spec, "static") == pytest.approx(_rate(spec, "equal"), rel=0.05)


def test_heterogeneous_cluster_static_beats_equal_and_nears_ideal():
  spec = sim.ClusterSpec(sim.mix(8), **QUIET)
  static, equal = _rate(spec, "static"), _rate(spec, "equal")
  assert static > 1.8 * equal
  own = sum(sim.single_host_samples_per_s(spec, g) for g in spec.gpus)
  assert static > 0.75 * own  # Less than 25% lost to the collective, padding and noise.


def test_more_hosts_never_slower_in_the_no_comm_limit():
  rates = [_rate(sim.ClusterSpec(sim.mix(n), grad_bytes=0.0, latency_s=0.0, **QUIET), "static")
           for n in (1, 2, 4, 8, 16)]
  assert all(b >= a * 0.98 for a, b in zip(rates, rates[1:])), rates


def test_dynamic_recovers_from_a_long_slow_spell_that_static_cannot():
  spec = sim.ClusterSpec(sim.mix(8), **QUIET)
  factors = sim.slowdowns(spec, 80, seed=0)
  factors[20:, 0] *= 3.0  # The H100 host slows down for good after warm-up.
  rate = {m: sim.simulate(spec, sim.make(m, spec), 80, factors=factors, measure_from=40)
          .samples_per_s for m in ("static", "dynamic")}
  assert rate["dynamic"] > 1.2 * rate["static"], rate


def test_same_seed_same_run():
  spec = sim.ClusterSpec(sim.mix(16))
  a = sim.simulate(spec, sim.make("dynamic", spec), 30, seed=3)
  b = sim.simulate(spec, sim.make("dynamic", spec), 30, seed=3)
  assert a.shares == b.shares and np.array_equal(a.step_s, b.step_s)
