"""DESIGN invariant 2: any host layout reaches the parameters of one device, for every model.

hetjax runs on 1 host x 1 device and on 3 hosts x 2 devices (a fixed uneven
split for 3 steps, then the split a static balancer solved from recorded
device timings) are compared with an independent oracle: a plain
`jax.grad` + optax loop written here, over the sampler's global batches, cut
into blocks of `m` positions with the block keys the contract names. The
oracle pads a partial block with junk (large noise), not with copies of a
real row as hetjax does, so a mask lost anywhere (the loss, BatchNorm's
statistics, an adapter) changes the oracle's result and not hetjax's, or the
other way round.

On 3x2, ResNet-10 and the transformer run with the device backend, the
linen and NNX models with the host backend (`ex.CLUSTER_REDUCTION`); on
1x1 each model runs with the other one (`ex.ONE_DEVICE_REDUCTION`). A
backend only sums one float32 row per device, whatever the model and the
split, so every model meets both backends and each backend meets all four
models, with a quarter of the trainers of the full product (the matrix was
a quarter of the suite's time). On 3x2
every host runs its own device batch (4, 2, 1 blocks per device per
program); on 1x1 one block. The 3x2 runs share one cluster start, and
tests/test_sharded_update.py and tests/test_device_batch.py read the same
runs (the session fixtures `exact_one_device` and `exact_clusters` in
conftest.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _exact_entries as ex
from hetjax.input import data
from hetjax.task import MASK, split_losses

RTOL, ATOL = 1e-4, 1e-5
CLUSTER_REDUCTION = ex.CLUSTER_REDUCTION  # See the module docstring.


def oracle(model: str, global_batch: int = ex.GLOBAL_BATCH):
  """Final (params, model state) of the plain loop: the semantics, written out."""
  return oracle_snapshots(model, (ex.STEPS,), global_batch)[ex.STEPS]


def oracle_snapshots(model: str, steps: tuple[int, ...], global_batch: int = ex.GLOBAL_BATCH):
  """{step: (params, model state) after it} of the plain loop, up to the last of `steps`."""
  source, task, optimizer = ex.build(model)
  sampler = data.GlobalSampler(len(source), global_batch, ex.SEED)
  m = ex.BLOCK

  junk_rng = np.random.default_rng(12345)

  def junk(v, n):
    """`n` padding rows that no real row resembles: large noise, or real values shuffled
    (integer features and labels stay valid indices)."""
    if np.issubdtype(v.dtype, np.floating):
      return (1e3 * junk_rng.standard_normal((n,) + v.shape[1:])).astype(v.dtype)
    return junk_rng.choice(v.reshape(-1), (n,) + v.shape[1:])

  def block_of(batch, k):
    rows = {key: v[k * m:(k + 1) * m] for key, v in batch.items()}
    real = len(next(iter(rows.values())))
    rows = {key: np.concatenate([v, junk(v, m - real)]) for key, v in rows.items()}
    rows[MASK] = (np.arange(m) < real).astype(np.float32)
    return rows

  example = block_of(source[np.arange(1)], 0)
  params, state = jax.jit(task.init)(jax.random.key(ex.SEED), example)
  opt_state = optimizer.init(params)

  @jax.jit
  def block_grad(params, state, block, step, k):
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(ex.SEED), step), k)
    def masked(p):
      losses, _, new_state = task.loss(p, state, block, rng)
      values, weights = split_losses(losses)  # A `Weighted` (tokens) divides by its weights.
      real = block[MASK] > 0
      weight = jnp.sum(jnp.where(real, 1.0 if weights is None else weights, 0.0))
      return jnp.sum(jnp.where(real, values, 0.0)), (new_state, weight)
    return jax.grad(masked, has_aux=True)(params)

  # Whole-tree steps under jit: op by op, each leaf shape compiled its own adds (4.9 s).
  zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))

  @jax.jit
  def accumulate(grads, new_state, g, s, n):
    return jax.tree.map(jnp.add, grads, g), jax.tree.map(lambda acc, x: acc + n * x, new_state, s)

  @jax.jit
  def update(params, opt_state, grads, new_state, weight):
    grads = jax.tree.map(lambda g: g / weight, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.tree.map(lambda s: s / global_batch, new_state))

  out = {}
  for step in range(max(steps)):
    batch = source[sampler.indices(step)]
    grads, new_state, weight = zeros(params), zeros(state), 0.0
    for k in range(-(-global_batch // m)):
      block = block_of(batch, k)
      g, (s, w) = block_grad(params, state, block, step, k)
      grads, new_state = accumulate(grads, new_state, g, s, block[MASK].sum())
      weight += float(w)
    params, opt_state, state = update(params, opt_state, grads, new_state, weight)
    if step + 1 in steps:
      out[step + 1] = jax.device_get((params, state))
  return out


# The matrix's end, and for the models it saves, the end of the sharded-update
# test's run resumed from them: one oracle run serves both files.
RESUMED_END = ex.STEPS + 2


@functools.cache
def cached_oracle(model: str) -> dict:
  """`oracle_snapshots` at ex.STEPS (and RESUMED_END for the saved models), once per session."""
  return oracle_snapshots(model, (ex.STEPS, RESUMED_END) if model in ex.SAVED else (ex.STEPS,))


@pytest.fixture(scope="module")
def one_device(exact_one_device):
  """1 host x 1 device: the matrix in this process (one cluster start fewer)."""
  return exact_one_device


@pytest.fixture(scope="module")
def cluster(exact_clusters):
  # Recorded timings (`ex.recorded_timings`), not measured ones: the same split every run.
  return exact_clusters[0]


def assert_close(got, want, what):
  leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), leaves_want, strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: {jax.tree_util.keystr(path)}")
  del leaves_got


@pytest.mark.parametrize("model", ex.MODELS)
def test_every_layout_matches_the_oracle(model, one_device, cluster):
  params, state = cached_oracle(model)[ex.STEPS]
  alone = ex.ONE_DEVICE_REDUCTION[model]
  assert_close(one_device[(model, alone)][0], params, f"1x1 {model} {alone} params")
  assert_close(one_device[(model, alone)][1], state, f"1x1 {model} {alone} state")
  reduction = CLUSTER_REDUCTION[model]
  for host, result in enumerate(cluster):
    assert_close(result[(model, reduction)][0], params, f"3x2 host {host} {model} {reduction}")
    assert_close(result[(model, reduction)][1], state, f"3x2 host {host} {model} state")


def test_the_layouts_really_differ(cluster):
  """Guards the test above: each 3x2 run met the uneven split, then the balancer moved it by the
  hosts' speeds; both backends ran; every host ran its device batch."""
  assert set(CLUSTER_REDUCTION.values()) == {"device", "host"} and set(CLUSTER_REDUCTION) == set(
      ex.MODELS)
  assert all(ex.ONE_DEVICE_REDUCTION[m] != r for m, r in CLUSTER_REDUCTION.items())
  for key in cluster[0]:
    shares = cluster[0][key][2]
    assert all(host[key][2] == shares for host in cluster), key  # Invariant 3.
    assert shares[:ex.FIXED_STEPS] == [ex.UNEVEN] * ex.FIXED_STEPS, (key, shares)
    assert shares[-1] != ex.UNEVEN and shares[-1][0] > shares[-1][2], (key, shares)
    for split in shares:
      assert all(e % ex.BLOCK == 0 or e == ex.GLOBAL_BATCH for e in np.cumsum(split))
    assert all(host[key][4] == list(ex.DEVICE_BATCHES) for host in cluster), key


def test_the_models_really_use_their_randomness_and_statistics():
  """Guards against comparing models where dropout or BatchNorm does nothing."""
  for model in ("linen", "nnx", "transformer"):
    _, task, _ = ex.build(model)
    source = ex.build(model)[0]
    batch = {k: v[:ex.BLOCK] for k, v in source[np.arange(ex.BLOCK)].items()}
    batch[MASK] = np.ones(ex.BLOCK, np.float32)
    params, state = jax.jit(task.init)(jax.random.key(0), batch)
    loss = jax.jit(task.loss)
    a = loss(params, state, batch, jax.random.key(1))[0]
    b = loss(params, state, batch, jax.random.key(2))[0]
    assert not np.allclose(a, b), f"{model}: the block key does not change the loss"
    if model != "transformer":
      assert set(state) == ({"batch_stats"} if model == "linen" else {"bn"})
