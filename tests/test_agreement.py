"""The hosts' agreement checks: fingerprints that see one bit, errors that name the host."""

import numpy as np
import pytest

from hetjax.training import agreement


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"dense": {"w": rng.normal(size=(8, 4)).astype(np.float32),
                    "b": rng.normal(size=(4,)).astype(np.float32)}}


def test_the_parameter_fingerprint_sees_one_ulp_a_swap_and_nothing_else():
  base = agreement.params_fingerprint(_params())
  assert base.shape == (agreement.FINGERPRINT_WIDTH,) and base.dtype == np.float32
  np.testing.assert_array_equal(agreement.params_fingerprint(_params()), base)
  one_ulp = _params()
  one_ulp["dense"]["w"][3, 2] = np.nextafter(one_ulp["dense"]["w"][3, 2], np.float32(np.inf))
  swapped = _params()
  w = swapped["dense"]["w"]
  w[0, 0], w[0, 1] = w[0, 1].copy(), w[0, 0].copy()
  for other in (one_ulp, swapped, _params(seed=1)):
    assert not np.array_equal(agreement.params_fingerprint(other), base)
  # 16-bit chunks: integers that float32 holds exactly, so the rows compare exactly.
  assert np.all(base == np.round(base)) and np.all((0 <= base) & (base < 2**16))


def test_shares_that_differ_name_the_odd_host_and_the_step():
  rows = np.array([[20, 24, 20], [20, 24, 20], [24, 20, 20]], np.float32)
  with pytest.raises(agreement.HostsDisagree, match=r"step 7: host\(s\) \[2\] computed another "
                     r"split .* than host 0, which used \(20, 24, 20\); host 2 used \(24, 20, 20\)"):
    agreement.check_shares(7, rows)
  agreement.check_shares(7, rows[:2])  # Two hosts that agree.


def test_fingerprints_that_differ_name_the_hosts_against_the_majority():
  fp = agreement.params_fingerprint(_params())
  rows = np.stack([agreement.params_fingerprint(_params(seed=5)), fp, fp])
  with pytest.raises(agreement.HostsDisagree, match=r"after step 100: host\(s\) \[0\] hold other "
                     "parameters than host 1"):
    agreement.check_fingerprints(100, rows)
  agreement.check_fingerprints(100, np.stack([fp, fp, fp]))


def test_text_fingerprints_are_exact_in_float32_and_differ_for_other_text():
  a, b = agreement.text_fingerprint("mlp|adam"), agreement.text_fingerprint("mlp|sgd")
  assert np.array_equal(a.astype(np.float32).astype(np.uint16).astype(np.float32), a)
  assert not np.array_equal(a, b)
  with pytest.raises(ValueError, match=r"host\(s\) \[1\] run a different model from host 0: fix"):
    agreement.check_all_equal(np.stack([a, b]), what="model", fix="fix")
