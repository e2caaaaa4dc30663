"""Behavioural checks of the simulated hybrid rounds (pure numpy, fast)."""

import dataclasses

import numpy as np
import pytest

from hetjax.sim import sync as sim
from hetjax.sim import rounds as sim_rounds

QUIET = dict(noise=0.0, straggler_rate=0.0, persistent_fraction=0.0)


def test_one_local_step_per_round_is_a_sync_step_with_the_equal_split():
  spec = sim.ClusterSpec(sim.mix(16), straggler_rate=1e-2)  # Noise, slow hosts and spells.
  sync = sim.simulate(spec, sim.make("equal", spec), 40, seed=3)
  hybrid = sim_rounds.simulate_rounds(spec, 1, 40, seed=3, outer_update=False, spells_per="slot")
  assert all(t == (1,) * 16 for t in hybrid.taus)
  np.testing.assert_allclose(hybrid.round_s, sync.step_s, rtol=1e-12)
  assert hybrid.samples_per_s == pytest.approx(sync.samples_per_s, rel=1e-12)


def test_outer_update_adds_the_slowest_hosts_memory_pass_once_per_round():
  spec = sim.ClusterSpec(("H100", "V100"), **QUIET)
  with_outer = sim_rounds.simulate_rounds(spec, 4, 12, measure_from=0)
  without = sim_rounds.simulate_rounds(spec, 4, 12, measure_from=0, outer_update=False)
  np.testing.assert_allclose(with_outer.round_s - without.round_s,
                             spec.optimizer_bytes / sim.HBM_BYTES_PER_S["V100"], rtol=1e-9)


def test_tau_follows_speeds_as_the_trainer_computes_it():
  from hetjax.modes import rounds  # The trainer's own formula (imports JAX).
  assert sim_rounds.SPEED_WINDOW == rounds.SPEED_WINDOW
  for step_s in ([1.0, 2.0, 4.0], [0.03, 0.031, 0.09, 0.2], [5.0]):
    for h in (1, 3, 4, 8):
      assert sim_rounds.taus_from_speeds(h, step_s) == rounds.taus_from_speeds(h, step_s)
  spec = sim.ClusterSpec(sim.mix(8), **QUIET)
  res = sim_rounds.simulate_rounds(spec, 8, 5, measure_from=0)
  step_s = spec.costs().predict(np.full(8, spec.per_host_batch))
  taus = np.array(res.taus[0])
  assert taus.max() == 8 and tuple(taus[:4]) == tuple(taus[4:])  # The H100 hosts run H.
  assert list(taus[:4]) == sorted(taus[:4], reverse=True)  # H100 > A100 > V100 = V100.
  assert tuple(taus) == sim_rounds.taus_from_speeds(8, step_s)
  # Every host's local steps fill about the same time: the fastest host's H steps.
  busy = taus * step_s
  assert busy.max() / busy.min() < 1.3


def test_one_reduction_per_round_whatever_the_local_steps():
  spec = sim.ClusterSpec(sim.mix(16), **QUIET)
  for h in (1, 4, 8):
    with_comm = sim_rounds.simulate_rounds(spec, h, 10, measure_from=0)
    without = sim_rounds.simulate_rounds(spec, h, 10, measure_from=0, comm=False)
    np.testing.assert_allclose(with_comm.round_s - without.round_s, spec.comm_s(), rtol=1e-9)


def test_round_time_is_the_slowest_hosts_local_steps_plus_the_reduction():
  spec = sim.ClusterSpec(sim.mix(4), **QUIET)
  res = sim_rounds.simulate_rounds(spec, 4, 3, measure_from=0, outer_update=False)
  step_s = spec.costs().predict(np.full(4, spec.per_host_batch))
  expect = max(t * s for t, s in zip(res.taus[0], step_s)) + spec.comm_s()
  np.testing.assert_allclose(res.round_s, expect, rtol=1e-12)
  assert res.samples_per_s == pytest.approx(sum(res.taus[0]) * spec.per_host_batch / expect)


def test_more_local_steps_raise_throughput_when_the_reduction_is_costly():
  slow_net = sim.ClusterSpec(sim.mix(16), bandwidth=1e9, **QUIET)  # 8 Gb/s: ~0.2 s a reduction.
  rates = [sim_rounds.simulate_rounds(slow_net, h, 20).samples_per_s for h in (1, 4, 8)]
  assert rates[0] < rates[1] < rates[2]
  assert rates[2] / rates[0] > 2.0
  fast_net = dataclasses.replace(slow_net, bandwidth=1e12)
  gain_fast = (sim_rounds.simulate_rounds(fast_net, 8, 20).samples_per_s
               / sim_rounds.simulate_rounds(fast_net, 1, 20).samples_per_s)
  assert gain_fast < rates[2] / rates[0]  # Less to win where the reduction is cheap.


def test_a_slow_spell_lengthens_the_round_it_falls_in():
  spec = sim.ClusterSpec(sim.mix(8), noise=0.0, straggler_rate=5e-3, persistent_fraction=0.0)
  res = sim_rounds.simulate_rounds(spec, 4, 60, seed=1, adapt=False, outer_update=False,
                                   spells_per="slot")
  quiet = sim_rounds.simulate_rounds(dataclasses.replace(spec, straggler_rate=0.0), 4, 60,
                                     seed=1, adapt=False, outer_update=False, spells_per="slot")
  spell = sim.spell_factors(spec, 60 * 4, seed=1).reshape(60, 4, 8) > 1.0
  hit = spell.any(axis=(1, 2))
  assert hit.any() and (~hit).any()
  np.testing.assert_allclose(res.round_s[~hit], quiet.round_s[~hit], rtol=1e-12)
  assert (res.round_s[hit] >= quiet.round_s[hit]).all()
  assert res.samples_per_s < quiet.samples_per_s


def test_tau_adapts_to_a_long_slow_spell_as_the_trainer_does():
  spec = sim.ClusterSpec(("H100",) * 8, noise=0.0, straggler_rate=5e-4, straggler_steps=1e6,
                         persistent_fraction=0.0)  # Spells that last the whole run.
  adapted = sim_rounds.simulate_rounds(spec, 8, 40, seed=0, spells_per="slot")
  fixed = sim_rounds.simulate_rounds(spec, 8, 40, seed=0, adapt=False, spells_per="slot")
  slowed = sim.spell_factors(spec, 40 * 8, seed=0)[-1] > 1.0
  assert 0 < slowed.sum() < 8  # Some hosts, not all, slowed at the end (seed 0).
  assert fixed.taus[-1] == (8,) * 8
  last = np.array(adapted.taus[-1])
  assert (last[slowed] == 3).all() and (last[~slowed] == 8).all()  # round(8 / 2.5) = 3.
  assert adapted.samples_per_s > fixed.samples_per_s
  quick = sim_rounds.simulate_rounds(spec, 8, 40, seed=0, spells_per="slot", speed_window=1)
  assert quick.samples_per_s > adapted.samples_per_s  # Reacting sooner wastes fewer rounds.


def test_spells_are_as_frequent_per_second_as_in_the_sync_runs():
  spec = sim.ClusterSpec(sim.mix(64), straggler_rate=2e-3, straggler_steps=20)
  step_s = spec.costs(0).predict(np.full(64, spec.per_host_batch))
  slot_s = float(step_s.min())
  sync_s = float(spec.costs(0).predict(sim.optimal_shares(spec, 0)).max()) + spec.comm_s()
  assert slot_s < sync_s / 2  # A slot (one H100 local step) is much shorter than a sync step.
  drawn = sim_rounds.spell_spec(spec, slot_s, 0)
  per_s = lambda s, dt: s.straggler_rate / dt
  assert per_s(drawn, slot_s) == pytest.approx(per_s(spec, sync_s))  # Starts per host-second.
  assert drawn.straggler_steps * slot_s == pytest.approx(spec.straggler_steps * sync_s)
  # Drawn per slot, the slowed share of host-time is the sync runs' share.
  slow_sync = (sim.spell_factors(spec, 4000, 0) > 1).mean()
  slow_slots = (sim.spell_factors(drawn, int(4000 * sync_s / slot_s), 0) > 1).mean()
  assert 0.7 < slow_slots / slow_sync < 1.4


def test_bad_rounds_input_is_refused():
  spec = sim.ClusterSpec(sim.mix(2))
  with pytest.raises(ValueError, match="round_steps"):
    sim_rounds.simulate_rounds(spec, 0)
  with pytest.raises(ValueError, match="local_batch"):
    sim_rounds.simulate_rounds(spec, 4, local_batch=0)
  with pytest.raises(ValueError, match="measure_from"):
    sim_rounds.simulate_rounds(spec, 4, 10, measure_from=10)
  with pytest.raises(ValueError, match="spells_per"):
    sim_rounds.simulate_rounds(spec, 4, 20, spells_per="step")
  with pytest.raises(ValueError, match="speed_window"):
    sim_rounds.simulate_rounds(spec, 4, 20, speed_window=0)
  with pytest.raises(ValueError, match="local step seconds"):
    sim_rounds.taus_from_speeds(4, [0.1, 0.0])
