"""`step/layer_gather.wrap` in one process: which leaves a layer gathers where it runs.

The gather here is the identity on whole leaves that records where it was
called (`after` None: at the loss's entry; otherwise inside a layer), so a
layer's math and its sown values can be compared with the plain loss.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.step import layer_gather


class Sowing(nn.Module):
  """A layer owning only its parameter that sows an auxiliary loss (as MoE routers do)."""

  @nn.compact
  def __call__(self, x):
    y = x @ self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 3))
    self.sow("intermediates", "aux", jnp.sum(y ** 2))
    return y


def _loss(keeps_sown: bool):
  def loss(params, x):
    y, state = Sowing().apply({"params": params}, x,
                              mutable=["intermediates"] if keeps_sown else False)
    aux = state["intermediates"]["aux"][0] if keeps_sown else 0.0
    return jnp.sum(y) + 0.1 * aux
  return loss


@pytest.mark.parametrize("keeps_sown", [False, True])
def test_a_layer_whose_sown_values_the_loss_keeps_is_gathered_at_the_entry(keeps_sown):
  """A sow on the layer's gathered copy would be lost (the auxiliary loss silently dropped):
  such a layer is gathered at the loss's entry; one whose sow nobody keeps, where it runs."""
  x = jnp.arange(8.0).reshape(2, 4)
  params = Sowing().init(jax.random.key(0), x)["params"]
  where: list[bool] = []  # Per gather: inside a layer?

  def gather(slab, axis, after):
    where.append(after is not None)
    return slab

  loss = _loss(keeps_sown)
  wrapped = layer_gather.wrap(loss, params, [0], gather)
  np.testing.assert_allclose(wrapped(params, x), loss(params, x), rtol=1e-6)
  grads = jax.grad(wrapped)(params, x)
  np.testing.assert_allclose(grads["w"], jax.grad(loss)(params, x)["w"], rtol=1e-6)
  assert where and all(w != keeps_sown for w in where), where
