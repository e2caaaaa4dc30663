"""DESIGN invariant 2: any host layout reaches the parameters of one device, for every model.

Three hetjax runs (1 host x 1 device; 3 hosts x 2 devices with a fixed uneven
split; 3 hosts x 2 devices with the split the static balancer solved from
recorded device timings) are compared with an independent oracle: a plain
`jax.grad` + optax loop written here, over the sampler's global batches, cut
into blocks of `m` positions with the block keys the contract names. The
oracle pads a partial block with junk (large noise), not with copies of a
real row as hetjax does, so a mask lost anywhere (the loss, BatchNorm's
statistics, an adapter) changes the oracle's result and not hetjax's, or the
other way round.

Every model runs with both reduction backends on one device; on the 3x2
clusters the uneven split uses the device backend and the moving static
split the host backend. A backend only sums one float32 row per device,
whatever the model and the split, so each model still meets each backend
and each layout across hosts, with half the clusters' trainers (the
matrix took a quarter of the suite's time). On 3x2 every host runs its own
device batch (4, 2, 1 blocks per device per program, issue 27); on 1x1 one
block. Both 3x2 layouts run in one cluster start, and
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
      values, _ = split_losses(losses)
      return jnp.sum(jnp.where(block[MASK] > 0, values, 0.0)), new_state
    return jax.grad(masked, has_aux=True)(params)

  # Whole-tree steps under jit: op by op, each leaf shape compiled its own adds (4.9 s).
  zeros = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))

  @jax.jit
  def accumulate(grads, new_state, g, s, n):
    return jax.tree.map(jnp.add, grads, g), jax.tree.map(lambda acc, x: acc + n * x, new_state, s)

  @jax.jit
  def update(params, opt_state, grads, new_state):
    grads = jax.tree.map(lambda g: g / global_batch, grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.tree.map(lambda s: s / global_batch, new_state))

  out = {}
  for step in range(max(steps)):
    batch = source[sampler.indices(step)]
    grads, new_state = zeros(params), zeros(state)
    for k in range(-(-global_batch // m)):
      block = block_of(batch, k)
      g, s = block_grad(params, state, block, step, k)
      grads, new_state = accumulate(grads, new_state, g, s, block[MASK].sum())
    params, opt_state, state = update(params, opt_state, grads, new_state)
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
def uneven(exact_clusters):
  return exact_clusters[0]["uneven"]


@pytest.fixture(scope="module")
def static(exact_clusters):
  # Recorded timings (`ex.recorded_timings`), not measured ones: the same split every run.
  return exact_clusters[0]["static"]


def assert_close(got, want, what):
  leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), leaves_want, strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: {jax.tree_util.keystr(path)}")
  del leaves_got


@pytest.mark.parametrize("model", ex.MODELS)
@pytest.mark.parametrize("reduction", ["device", "host"])
def test_every_layout_matches_the_oracle(model, reduction, one_device, uneven, static):
  params, state = cached_oracle(model)[ex.STEPS]
  assert_close(one_device[(model, reduction)][0], params, f"1x1 {model} params")
  assert_close(one_device[(model, reduction)][1], state, f"1x1 {model} state")
  for layout, results in (("uneven", uneven), ("static", static)):
    if reduction not in CLUSTER_REDUCTION[layout]:
      continue
    for host, result in enumerate(results):
      assert_close(result[(model, reduction)][0], params, f"3x2 {layout} host {host} {model}")
      assert_close(result[(model, reduction)][1], state, f"3x2 {layout} host {host} {model} state")


def test_the_layouts_really_differ(uneven, static):
  """Guards the test above: the splits are uneven, static moved off the equal split, and the
  clusters ran their device batches."""
  assert {r for rs in CLUSTER_REDUCTION.values() for r in rs} == {"device", "host"}
  shares = uneven[0][("resnet18", "device")][2]
  assert set(shares) == {ex.UNEVEN}
  for results in (uneven, static):
    assert all(r[4] == list(ex.DEVICE_BATCHES) for host in results for r in host.values())
  static_shares = static[0][("resnet18", "host")][2]
  assert static_shares[-1] != static_shares[0]          # The solved split differs from equal,
  assert static_shares[-1][0] > static_shares[-1][2]    # and follows the emulated speeds.
  for shares in static_shares:
    assert all(e % ex.BLOCK == 0 or e == ex.GLOBAL_BATCH for e in np.cumsum(shares))


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
