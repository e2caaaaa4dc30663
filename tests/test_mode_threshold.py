"""The sync/hybrid threshold the mode advice quotes (bench/modes.py, bench/simulate.py)."""

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).parents[1] / "bench"


def _bench(name):
  spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_at_the_threshold_both_modes_reach_the_target_together():
  modes = _bench("modes")
  # (s, samples, accuracy, reductions, reduction s) at the target, two seeds each.
  sync = [(4.0, 480, 0.97, 10, 2.0), (4.4, 528, 0.97, 11, 2.2)]
  hybrid = [(3.0, 530, 0.97, 3, 0.6), (3.2, 580, 0.98, 3, 0.7)]
  found = modes.reduction_threshold(sync, hybrid)
  t_s, n_s, r_s, t_h, n_h = 4.2, 10.5, 2.1, 3.1, 3
  added = found["added_reduction_s"]
  assert t_s + n_s * added == pytest.approx(t_h + n_h * added)
  step, reduction = t_s / n_s, r_s / n_s
  assert found["threshold_share"] == pytest.approx((reduction + added) / (step + added))
  assert found["sync_reduction_share"] == pytest.approx(0.5)
  assert found["samples_ratio"] == pytest.approx(555 / 504)


def test_a_mode_with_as_many_reductions_as_sync_has_no_threshold():
  modes = _bench("modes")
  found = modes.reduction_threshold([(4.0, 480, 0.97, 10, 2.0)], [(3.0, 480, 0.97, 10, 1.0)])
  assert found["threshold_share"] is None
  assert modes.reduction_threshold([(4.0, 480, 0.97, 10, 2.0)], [None]) is None


def test_slower_links_favour_hybrid_and_longer_rounds_cross_first():
  out = _bench("simulate").mode_threshold(1.11, steps=40, seeds=(0,))
  shares = [row["reduction_share"] for row in out["rows"]]
  assert shares == sorted(shares)  # The sweep goes to slower links.
  for h in (4, 8):
    ratios = [row[f"hybrid{h}_over_sync"] for row in out["rows"]]
    assert ratios[-1] > ratios[0]
    assert out["threshold_share"][str(h)] is not None
  assert out["threshold_share"]["8"] < out["threshold_share"]["4"]
