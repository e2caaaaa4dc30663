"""Behavioural checks of the simulated cluster (pure numpy, fast)."""

import dataclasses

import numpy as np
import pytest

from hetjax import sim

QUIET = dict(noise=0.01, straggler_rate=0.0)


def _rate(spec, mode, steps=40, seed=0):
  return sim.simulate(spec, sim.make(mode, spec), steps, seed=seed).samples_per_s


def test_ring_allreduce_cost():
  assert sim.ring_allreduce_s(1, 1e8, 1e9, 1e-5) == 0.0
  assert sim.ring_allreduce_s(4, 1e8, 1e9, 1e-5) == pytest.approx(6 * 1e-5 + 1.5 * 0.1)


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
