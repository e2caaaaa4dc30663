"""A padded LM weighted by tokens reaches a plain optax loop's parameters (issue 51).

examples/lm_padded.py (layers under `nn.scan` + `nn.remat`, attention taking
`mask=`, sequences of 3 to 16 tokens padded to 16) trains with SGD on 3
uneven emulated hosts x 2 devices, once with device batches and once
sharded within each host. The reference below imports nothing of hetjax:
the example's Flax module and numpy arrays, `model.apply`, the token mean
`sum(losses * mask) / sum(mask)` over the whole batch, and optax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _lm_padded_entries as entries
from hetjax.testing import run_hosts

RTOL = 1e-5  # Per leaf: max |hetjax - reference| / max |reference|.
# Softmax ignores a bias added to every key, so this leaf's true gradient is zero and it
# holds rounding noise alone (2.3e-9 after 5 steps): checked in absolute terms.
NOISE = "['layers']['MultiHeadDotProductAttention_0']['key']['bias']"


def reference(initial, token_mean: bool = True):
  """Parameters after `STEPS` of plain SGD on the whole data set."""
  lm_padded = entries.example()
  data = lm_padded.arrays(entries.RECORDS, 0)
  model = lm_padded.PaddedLM()
  tokens, mask = jnp.asarray(data["x"]), jnp.asarray(data["x_mask"])
  real = mask[:, :-1] * mask[:, 1:]  # A target counts when it and its input are real.

  def loss(params):
    logits = model.apply({"params": params}, tokens, mask=mask)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]) * real
    if token_mean:
      return losses.sum() / real.sum()
    return (losses.sum(1) / real.sum(1)).mean()  # Each sequence's mean: another objective.

  optimizer = optax.sgd(entries.LR)
  step = jax.jit(lambda p, s: (lambda u, s: (optax.apply_updates(p, u), s))(
      *optimizer.update(jax.grad(loss)(p), s, p)))
  params, state = initial, optimizer.init(initial)
  for _ in range(entries.STEPS):
    params, state = step(params, state)
  return jax.tree.map(np.asarray, params)


def _relative(got, want):
  """{leaf: max |got - want| / max |want|}, and the noise leaf's largest absolute value."""
  out = {jax.tree_util.keystr(path): float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
         for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                                 strict=True)}
  noise = got["layers"]["MultiHeadDotProductAttention_0"]["key"]["bias"]
  del out[NOISE]
  return out, float(np.max(np.abs(noise)))


@pytest.fixture(scope="module")
def hosts():
  return run_hosts("_lm_padded_entries:train", hosts=3, devices_per_host=2, timeout_s=900)


@pytest.mark.parametrize("name", list(entries.CONFIGS))
def test_the_padded_lm_matches_a_plain_optax_loop_per_leaf(hosts, name):
  initial = hosts[0][name][0]
  for host in hosts:  # Every host started from, and ended on, the same parameters.
    jax.tree.map(np.testing.assert_array_equal, host[name][0], initial)
    jax.tree.map(np.testing.assert_array_equal, host[name][1], hosts[0][name][1])
  assert initial["layers"]["Dense_0"]["bias"].shape[0] == 2  # Stacked by nn.scan.
  want = reference(initial)
  errors, noise = _relative(hosts[0][name][1], want)
  print(f"{name}: max per-leaf relative {max(errors.values()):.1e}, noise leaf {noise:.1e}")
  assert max(errors.values()) < RTOL, sorted(errors.items(), key=lambda e: -e[1])[:5]
  assert noise < 1e-7
  # The comparison can tell the objectives apart: the per-sequence mean lands far away.
  other, _ = _relative(reference(initial, token_mean=False), want)
  assert max(other.values()) > 100 * RTOL
