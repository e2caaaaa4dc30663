"""The optimizer zoo, trained by hetjax on any layout (run on every host).

A user's model, written here with Flax and nothing of hetjax: two Dense
layers (biases start at 1, so a decay applied to them shows) around a
LayerNorm (its scale and bias are vectors). The data are the first
`RECORDS` handwritten digits and the global batch is all of them, so every
step's gradient is the full-batch mean whatever order the sampler draws
the records in: the oracle (tests/test_optimizer_zoo.py) needs no sampler,
no blocks and no loss adapter, only `model.apply` and optax.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.input import sources

RECORDS = 48            # = the global batch: every step sees every record.
BLOCK = 8               # 6 blocks; 3 hosts take 3, 2 and 1 of them.
UNEVEN = (24, 16, 8)
STEPS = 4
CHECK_EVERY = 2         # Agreement checks on 3x2 at steps 2 and 4 (bit-identical replicas).


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(24, bias_init=nn.initializers.ones)(x.reshape(x.shape[0], -1))
    x = nn.tanh(nn.LayerNorm(use_fast_variance=False)(x))
    return nn.Dense(10, bias_init=nn.initializers.ones)(x)


def arrays() -> dict[str, np.ndarray]:
  # scikit-learn's digits file, its first records in its own order (read
  # without importing scikit-learn and SciPy on every host).
  table = sources.digits_table()[:RECORDS]
  return {"x": (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32),
          "y": table[:, -1].astype(np.int32)}


def initial_params():
  """The same parameters on every host and in the oracle (a fixed key, no rng passed in)."""
  return Net().init(jax.random.key(0), jnp.zeros((1, 8, 8), jnp.float32))["params"]


def scale_by_fan_in() -> optax.GradientTransformation:
  """A user's own transformation whose update depends on a leaf's shape."""
  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u: u / u.shape[0], updates), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def by_ndim(params):
  return jax.tree.map(lambda p: p.ndim > 1, params)


OPTIMIZERS = {
    "adamw, no decay on vectors": lambda: optax.adamw(3e-2, weight_decay=0.5, mask=by_ndim),
    "multi_transform by ndim": lambda: optax.multi_transform(
        {"matrix": optax.adam(3e-2), "vector": optax.sgd(0.1)},
        lambda p: jax.tree.map(lambda a: "matrix" if a.ndim > 1 else "vector", p)),
    "adafactor": lambda: optax.adafactor(3e-2, min_dim_size_to_factor=8),
    "muon": lambda: optax.contrib.muon(3e-2),
    "lion": lambda: optax.lion(3e-3),
    "lamb": lambda: optax.lamb(3e-2),
    "nesterov, clipped": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                             optax.sgd(0.1, momentum=0.9, nesterov=True)),
    "MultiSteps(adam, 2)": lambda: optax.MultiSteps(optax.adam(3e-2), every_k_schedule=2),
    "schedule-free adamw": lambda: optax.contrib.schedule_free_adamw(3e-2, warmup_steps=2),
    "user's fan-in scaling": lambda: optax.chain(scale_by_fan_in(), optax.sgd(0.3)),
}


def train_zoo(plan: tuple[tuple[str, str], ...], assignment):
  """{(optimizer, reduction): (this host's final params as numpy, the update layout)} for
  every (optimizer name, reduction backend) of `plan`."""
  import hetjax
  from hetjax import trainer as trainer_lib

  def per_example_loss(params, batch, rng):
    del rng
    logits = Net().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {}

  hetjax.initialize()
  info = hetjax.DatasetInfo("zoo-digits", "digits", num_classes=10)
  source = hetjax.ArraySource(arrays(), info)
  task = hetjax.from_functions(lambda rng, batch: initial_params(), per_example_loss)
  out = {}
  for name, reduction in plan:
    config = trainer_lib.TrainConfig(global_batch=RECORDS, microbatch=BLOCK, seed=1,
                                     reduction=reduction, assignment=assignment,
                                     check_every=CHECK_EVERY)
    tr = trainer_lib.Trainer(task, OPTIMIZERS[name](), source, config)
    tr.fit(STEPS)
    layout = tr.mode.update_layout  # None on one device (the fused update)
    out[(name, reduction)] = (jax.tree.map(np.asarray, tr.params()),
                              None if layout is None else layout.layout)
    tr.close()
  return out
