"""The balancer at scale, in the simulator: sane shares, honest predictions, dynamic >= static.

16, 256 and 1024 hosts x slow-spell rates 0, 1e-3, 1e-2 x three seeds, both
profiling modes on identical conditions (pure numpy, deterministic; the
whole grid runs in seconds). SIMULATED clusters; see hetjax.sim.ASSUMPTIONS.
"""

import functools

import numpy as np
import pytest

from hetjax.sim import sync as sim

HOSTS = (16, 256, 1024)
RATES = (0.0, 1e-3, 1e-2)
SEEDS = (0, 1, 2)
STEPS = 40
WARMUP = 7  # The balancer's default warm-up: equal split, then two probes.
# A slow spell is "fresh" until the balancer can have answered it: the level
# median turns within ~half_life + 1 steps, then the next re-solve (every 3).
FRESH = 9


@functools.lru_cache(maxsize=None)
def _run(n, rate, seed, mode):
  spec = sim.ClusterSpec(sim.mix(n), straggler_rate=rate)
  bal = sim.make(mode, spec)
  return spec, sim.simulate(spec, bal, STEPS, seed=seed, measure_from=WARMUP + 3)


def _predicted_step(decisions):
  """Per step, the predicted compute time of the split the balancer chose for it."""
  pred = np.full(STEPS, np.nan)
  for d in decisions:
    if d["predicted_s"] is not None:
      pred[d["step"]:] = d["predicted_s"]
  return pred


@pytest.mark.parametrize("n", HOSTS)
@pytest.mark.parametrize("rate", RATES)
def test_no_host_gets_more_than_twice_its_noise_free_optimal_share(n, rate):
  for seed in SEEDS:
    for mode in ("static", "dynamic"):
      spec, run = _run(n, rate, seed, mode)
      optimal = np.asarray(sim.optimal_shares(spec, seed))
      shares = np.asarray(run.shares[WARMUP:])
      # One micro-batch of slack: shares come in whole micro-batches.
      worst = ((shares - spec.granularity) / np.maximum(optimal, 1)).max()
      assert worst <= 2.0, (mode, seed, worst)


@pytest.mark.parametrize("n", HOSTS)
@pytest.mark.parametrize("rate", RATES)
def test_no_step_takes_more_than_1_5x_the_prediction_except_in_a_fresh_slow_spell(n, rate):
  for seed in SEEDS:
    for mode in ("static", "dynamic"):
      spec, run = _run(n, rate, seed, mode)
      spell = sim.spell_factors(spec, STEPS, seed) > 1.0
      # Static never answers a spell by design: every spell stays "fresh" to it.
      excused = sim.fresh_spells(spec, STEPS, seed, FRESH) if mode == "dynamic" else spell
      pred = _predicted_step(run.decisions)
      measured = np.where(excused, 0.0, run.compute_s).max(axis=1)
      ratio = (measured / pred)[WARMUP + 1:]
      assert np.nanmax(ratio) <= 1.5, (mode, seed, np.nanmax(ratio), int(np.nanargmax(ratio)))


@pytest.mark.parametrize("n", HOSTS)
@pytest.mark.parametrize("rate", RATES)
def test_dynamic_never_loses_to_static(n, rate):
  for seed in SEEDS:
    static = _run(n, rate, seed, "static")[1].samples_per_s
    dynamic = _run(n, rate, seed, "dynamic")[1].samples_per_s
    assert dynamic >= 0.95 * static, (seed, dynamic / static)


def test_fresh_spells_are_the_first_steps_of_each_spell():
  spec = sim.ClusterSpec(sim.mix(64), straggler_rate=0.02)
  spell = sim.spell_factors(spec, 60, 4) > 1.0
  fresh = sim.fresh_spells(spec, 60, 4, 2)
  assert spell.any() and (fresh <= spell).all()
  for s, h in zip(*np.nonzero(spell)):
    began = s
    while began > 0 and spell[began - 1, h]:
      began -= 1
    assert fresh[s, h] == (s - began <= 2)
