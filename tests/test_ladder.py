"""Micro-batch ladders in the balancer: the cost of a share is a step function of its programs.

Pure numpy. A host with device batches of `k` blocks runs full programs of
`k` rounds and the remainder through `k/2, ..., 1`; the solver must hand
out shares that waste no micro-batch (exactly optimal against brute force),
and `k = 1` must decide as before.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetjax import balancer, blocks
from hetjax.balancer import Ladder, Ladders

FAST = settings(max_examples=80, deadline=None)


@st.composite
def ladder_problems(draw, max_hosts=3, max_batch=22):
  """Hosts with ladders of k in (1, 2, 4, 8), program times that favour big programs, caps, floors."""
  n = draw(st.integers(1, max_hosts))
  batch = draw(st.integers(1, max_batch))
  ladders = []
  for _ in range(n):
    k = draw(st.sampled_from((1, 2, 4, 8)))
    unit = draw(st.integers(1, 3))
    launch = draw(st.floats(0.0, 1.0))
    # A program of s rounds: a launch plus s rounds at a speed that rises with s.
    per = [draw(st.floats(0.3, 1.0)) for _ in balancer.halving(k)]
    times = [launch + s * v for s, v in zip(balancer.halving(k), sorted(per))]
    ladders.append(Ladder.of(unit, k, times))
  fixed = draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
  per_unit = draw(st.lists(st.floats(0.2, 1.2), min_size=n, max_size=n))
  caps = [draw(st.integers(-(-batch // n), batch)) for _ in range(n)]
  floors = [draw(st.integers(0, min(c, batch // n))) for c in caps]
  return batch, fixed, per_unit, ladders, caps, floors


def _params(fixed, per_unit, ladders):
  lad = Ladders(ladders)
  return balancer.CostParams(np.asarray(fixed), np.asarray(per_unit), lad.unit, lad)


@FAST
@given(ladder_problems())
def test_solve_on_ladders_is_optimal_by_brute_force(problem):
  batch, fixed, per_unit, ladders, caps, floors = problem
  got = balancer.solve(batch, fixed, per_unit, caps=caps, floors=floors, ladders=ladders)
  assert sum(got) == batch and all(f <= g <= c for f, g, c in zip(floors, got, caps))
  params = _params(fixed, per_unit, ladders)
  best = min(params.predict(c).max()
             for c in itertools.product(*[range(f, c + 1) for f, c in zip(floors, caps)])
             if sum(c) == batch)
  assert params.predict(got).max() <= best * (1 + 1e-9) + 1e-12


def test_a_ladder_prices_the_programs_a_share_runs():
  lad = Ladder.of(8, 8, program_s=[3.0, 1.8, 1.1, 0.7])  # 8 devices, k = 8.
  assert lad.sizes == (8, 4, 2, 1) and lad.work[-1] == 8
  assert lad.programs(64) == {8: 1} and lad.programs(63) == {8: 1}  # 1 block padded.
  assert lad.programs(56) == {4: 1, 2: 1, 1: 1}  # 7 rounds: three programs.
  assert lad.programs(130) == {8: 2, 1: 1}
  work = Ladders([lad]).work
  assert work([[56]])[0, 0] > work([[64]])[0, 0]  # 7 rounds cost more than 8: not rising.


def test_k1_ladders_are_the_old_padded_cost():
  lad = Ladders([Ladder.of(4, 1), Ladder(3)])
  shares = np.array([[0, 1], [5, 7], [8, 9]])
  assert lad.trivial
  np.testing.assert_array_equal(lad.work(shares), balancer.padded(shares, [4, 3]))


def test_the_solver_avoids_a_share_that_wastes_micro_batches():
  # Two equal hosts of 8 devices with k = 8: 8 rounds take one program, 7
  # rounds three. 120 blocks: 64 + 56 would leave host 1 on three programs
  # (4 + 2 + 1 rounds, 1.2x the time of one full program); any split of 57 to
  # 63 blocks each runs one program per host, padded. Without the solver's
  # repair of a level's last share (`_within_level`) it hands out (64, 56).
  lad = Ladder.of(8, 8, program_s=[3.0, 1.8, 1.1, 0.7])
  got = balancer.solve(120, [0.0, 0.0], [1.0, 1.0], ladders=[lad, lad])
  params = _params([0.0, 0.0], [1.0, 1.0], [lad, lad])
  assert sum(got) == 120
  assert got not in ((64, 56), (56, 64)), got
  assert [lad.programs(share) for share in got] == [{8: 1}, {8: 1}], got
  assert params.predict(got).max() < params.predict([64, 56]).max()


def test_k1_block_balancer_decides_as_before_and_keeps_its_state_format():
  over, per = np.array([0.025, 0.0135, 0.022]), np.array([5e-3, 1e-2, 2e-2])
  true = balancer.CostParams(over, per, np.full(3, 2))
  runs = []
  for ks in (None, [1, 1, 1]):
    bal = blocks.make_block_balancer("equal", 192, 4, [2, 2, 2], mode="dynamic",
                                     device_batches=ks)
    rng = np.random.default_rng(0)
    for s in range(30):
      shares = bal.shares(s)
      b = blocks.to_blocks(shares, 192, 4)
      bal.observe(s, shares, (true.predict(b) * np.exp(0.015 * rng.standard_normal(3))).tolist())
    runs.append((bal.shares(30), bal.state_dict()))
  assert runs[0] == runs[1] and "ladders" not in runs[0][1]["inner"]


def test_dynamic_balancer_on_ladders_ends_on_efficient_shares_and_beats_k1():
  # Three hosts of 4 devices; host 0 twice as fast. Big programs are 2x as
  # efficient per block as single rounds: k = 4 must beat k = 1 and its shares
  # must be efficient for the ladder it runs (no cheaper larger share).
  def program_s(k):
    return [0.5 + s * (1.0 if s == 1 else 0.5) for s in balancer.halving(k)]
  speed = np.array([2.0, 1.0, 1.0])
  batch = 96  # Blocks.
  results = {}
  for k in (1, 4):
    lads = [Ladder.of(4, k, program_s(k)) for _ in range(3)]
    true = balancer.CostParams(np.full(3, 0.05), 0.01 / speed, np.full(3, 4), Ladders(lads))
    bal = balancer.make_balancer("equal", batch, 3, mode="dynamic", granularity=[4] * 3,
                                 ladders=lads)
    rng = np.random.default_rng(1)
    times = []
    for s in range(40):
      shares = bal.shares(s)
      t = true.predict(shares) * np.exp(0.01 * rng.standard_normal(3))
      bal.observe(s, shares, t.tolist())
      times.append(t.max())
    final = np.asarray(bal.shares(40))
    results[k] = np.mean(times[20:])
    lad = Ladders(lads)
    for h in range(3):
      bigger = np.arange(final[h] + 1, batch + 1)
      if len(bigger):
        cost_h = lad.work(np.where(np.arange(3) == h, final[h], 0)[None])[0, h]
        larger = lad.work(np.where(np.arange(3)[None] == h, bigger[:, None], 0))[:, h]
        assert larger.min() > cost_h - 1e-9, (k, h, final)
  assert results[4] < 0.7 * results[1], results


def test_ladders_travel_in_the_state_and_must_match():
  lads = [Ladder.of(2, 4), Ladder.of(2, 2)]
  bal = balancer.make_balancer("equal", 40, 2, mode="static", ladders=lads)
  state = bal.state_dict()
  assert state["ladders"][0]["sizes"] == [4, 2, 1]
  other = balancer.make_balancer("equal", 40, 2, mode="static", ladders=[Ladder.of(2, 2)] * 2)
  with pytest.raises(ValueError, match="another configuration"):
    other.load_state_dict(state)
  same = balancer.make_balancer("equal", 40, 2, mode="static", ladders=lads)
  same.load_state_dict(state)


def test_ladder_errors_name_the_value_and_the_fix():
  with pytest.raises(ValueError, match="end with 1"):
    Ladder(4, (4, 2))
  with pytest.raises(ValueError, match=">= 1 block per device"):
    Ladder.of(4, 0)
  with pytest.raises(ValueError, match="one time > 0 per program size"):
    Ladder.of(4, 4, program_s=[1.0, 2.0])
  with pytest.raises(ValueError, match="one entry per host"):
    blocks.make_block_balancer("equal", 64, 4, [2, 2], mode="static", device_batches=[1])


def test_the_cost_model_identifies_the_fixed_cost_on_ladders():
  # The fixed cost stays identifiable when a share's work is a step function:
  # the fit reads shares through the same ladder the host runs.
  rng = np.random.default_rng(0)
  lads = [Ladder.of(8, 8, [0.5 + s * 0.6 for s in balancer.halving(8)]),
          Ladder.of(4, 4, [0.3 + s for s in balancer.halving(4)]), Ladder.of(16, 1)]
  fixed, per = np.array([0.02, 0.005, 0.1]), np.array([1e-3, 4e-3, 2e-4])
  true = balancer.CostParams(fixed, per, Ladders(lads).unit, Ladders(lads))
  model = balancer.CostModel(3, ladders=lads, window=32)
  for _ in range(32):
    shares = rng.integers(1, 400, size=3)
    model.observe(shares, true.predict(shares) * (1 + 0.02 * rng.standard_normal(3)))
  fit = model.fit()
  np.testing.assert_allclose(fit.per_sample_s, per, rtol=0.1)
  np.testing.assert_allclose(fit.fixed_s, fixed, rtol=0.25, atol=0.002)
