"""Device batches (issue 27): `k` blocks per device per micro-batch, the math of `k = 1`.

(a) in this process: one `LocalProgram` share run with k = 1, 2 and 4 gives
the same sums on a BatchNorm + Dropout model, with an uneven share and a
partial last block; (b) on a 3 hosts x 2 devices cluster with device
batches (4, 2, 1): four models, a fixed uneven split and a balanced one,
against an independent `jax.grad` + optax oracle written here; and 200
dynamic-balancer steps whose shares move compile nothing after the start.
"""

import concurrent.futures

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _device_batch_entries as ent
import hetjax
from hetjax import cli, mesh, step
from hetjax.balancer import ladder
from hetjax.input import data
from hetjax.step import local as local_step
from hetjax.task import MASK, split_losses
from hetjax.testing import run_hosts

RTOL, ATOL = 1e-4, 1e-5


class _BatchNormDropout(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(
        x, mask=None if mask is None else mask[:, None] > 0)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


def _task():
  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {
        "correct": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}
  return hetjax.from_linen(_BatchNormDropout(), loss)


def test_position_rows_give_each_device_its_blocks_and_its_real_rows():
  host = np.array([0.5], np.float32)
  rows = local_step._position_rows(step=2, first_block=10, first=False, real=13, per_device=4,
                                   devices=2, host_values=host, blocks=2)
  np.testing.assert_array_equal(rows[:, :4], [[2, 10, 0, 8], [2, 12, 0, 5]])
  np.testing.assert_array_equal(rows[:, 4:].view(np.float32), [host, host])


def test_device_batches_give_the_sums_of_single_blocks():
  """k = 1, 2, 4 on one share of 26 rows (7 blocks of 4, the last half real)."""
  meshes = mesh.Meshes.create()
  rng = np.random.default_rng(0)
  batch = {"x": rng.standard_normal((26, 5)).astype(np.float32),
           "y": rng.integers(0, 3, 26).astype(np.int32)}
  example = {k: v[:1] for k, v in batch.items()}
  task, optimizer = _task(), optax.sgd(0.1)
  init = next(step.micro_batches(example, 4))
  state = mesh.to_local_tree(step.init_state(task, optimizer, meshes, init, 0), meshes)
  key, host = jax.random.key(1), np.ones(1, np.float32)
  sums, plans = {}, {}
  for k in (1, 2, 4):
    local = step.LocalProgram(task, optimizer, meshes, 4, device_batch=k)
    plans[k] = local.programs(len(batch["x"]))
    out = local(state, None, batch, example, key, 5, first_block=3, host_values=host)
    sums[k] = jax.device_get(out.sums.totals())
  devices = meshes.local_devices
  for k, plan in plans.items():  # The step runs what the balancer prices.
    assert sum(plan) == -(-7 // devices)
    assert {j: plan.count(j) for j in plan} == ladder.Ladder.of(devices, k).programs(7)
  assert float(sums[1].count) == 26
  for k in (2, 4):
    for a, b in zip(jax.tree.leaves(sums[k]), jax.tree.leaves(sums[1]), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Dropout keys follow the block's global index: another first block differs.
  other = local(state, None, batch, example, key, 5, first_block=4, host_values=host)
  assert not np.allclose(jax.device_get(other.sums.totals().loss), sums[1].loss)


def test_a_device_batch_below_one_is_refused():
  with pytest.raises(ValueError, match="--device-batch must be >= 1"):
    step.LocalProgram(_task(), optax.sgd(0.1), mesh.Meshes.create(), 4, device_batch=0)


@pytest.mark.parametrize("value, message", [
    ("0", "--device-batch 0: every host needs >= 1 block per device"),
    ("4,2", "--device-batch 4,2 gives 2 values for 1 host(s)"),
    ("two", "--device-batch 'two': 'two' is not a whole number of blocks"),
])
def test_a_bad_device_batch_fails_before_jax_with_the_fix(capsys, value, message):
  with pytest.raises(SystemExit) as stop:
    cli.main(["train", "--device-batch", value, "--print-config"])
  assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_config_file_gives_one_device_batch_per_host(tmp_path):
  path = tmp_path / "run.yaml"  # A config file's list is the flag's comma-separated value.
  path.write_text("device-batch: [4, 2, 1]\ndevice-batch-memory-fraction: 0.5\n")
  args = cli.parse_args(["train", "--config", str(path)])
  assert cli.commands._train_config(args).device_batches(3) == (4, 2, 1)
  assert cli.commands._train_config(args).device_batch_memory_fraction == 0.5


# ---- (b) 3 hosts x 2 devices with device batches (4, 2, 1) against an oracle ----


def oracle(model: str, snapshots=(ent.FIXED_STEPS, ent.STEPS)):
  """{steps: (params, model state)} of a plain `jax.grad` + optax loop: the semantics.

  Each block of `m` consecutive positions of the sampler's global batch is
  its own BatchNorm group, with the key `fold_in(fold_in(key(seed), step),
  block)`; gradients are summed over real examples and divided by their
  count (or weight), and the model state is the count-weighted mean of the
  blocks' states. A partial block is padded with large noise (not a copy of
  a real row, as hetjax pads), so a mask lost anywhere shows.
  """
  source, task, optimizer = ent.build(model)
  sampler = data.GlobalSampler(len(source), ent.GLOBAL_BATCH, ent.SEED)
  m, noise = ent.BLOCK, np.random.default_rng(7)

  def block_of(batch, b):
    rows = {k: v[b * m:(b + 1) * m] for k, v in batch.items()}
    pad = m - len(rows["y"] if "y" in rows else next(iter(rows.values())))
    fill = lambda v: ((1e3 * noise.standard_normal((pad,) + v.shape[1:])).astype(v.dtype)
                      if np.issubdtype(v.dtype, np.floating) else
                      noise.choice(v.reshape(-1), (pad,) + v.shape[1:]))
    out = {k: np.concatenate([v, fill(v)]) for k, v in rows.items()}
    out[MASK] = (np.arange(m) < m - pad).astype(np.float32)
    return out

  params, state = jax.jit(task.init)(jax.random.key(ent.SEED), block_of(source[np.arange(1)], 0))
  opt_state = optimizer.init(params)

  @jax.jit
  def block_grad(params, state, block, step, b):
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(ent.SEED), step), b)
    real = block[MASK] > 0

    def loss(p):
      losses, _, new_state = task.loss(p, state, block, rng)
      values, weights = split_losses(losses)
      weight = jnp.sum(real) if weights is None else jnp.sum(jnp.where(real, weights, 0.0))
      return jnp.sum(jnp.where(real, values, 0.0)), (new_state, weight)

    return jax.grad(loss, has_aux=True)(params)

  @jax.jit
  def update(params, opt_state, grads, weight):
    updates, opt_state = optimizer.update(jax.tree.map(lambda g: g / weight, grads), opt_state,
                                          params)
    return optax.apply_updates(params, updates), opt_state

  out = {}
  for s in range(max(snapshots)):
    batch = source[sampler.indices(s)]
    grads, weight, states, counts = None, 0.0, [], []
    for b in range(-(-ent.GLOBAL_BATCH // m)):
      block = block_of(batch, b)
      g, (new_state, w) = block_grad(params, state, block, s, b)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
      weight += float(w)
      states.append(new_state)
      counts.append(float(block[MASK].sum()))
    params, opt_state = update(params, opt_state, grads, weight)
    state = jax.tree.map(lambda *xs: sum(c * x for c, x in zip(counts, xs)) / sum(counts),
                         *states)
    if s + 1 in snapshots:
      out[s + 1] = jax.device_get((params, state))
  return out


def one_device(model: str):
  """(params, model state) of hetjax on 1 host x 1 device with k = 1, after the fixed steps."""
  source, task, optimizer = ent.build(model)
  tr = hetjax.Trainer(task, optimizer, source, hetjax.TrainConfig(
      global_batch=ent.GLOBAL_BATCH, microbatch=ent.BLOCK, seed=ent.SEED, check_every=0))
  tr.fit(ent.FIXED_STEPS)
  out = jax.device_get((tr.params(), tr.state.model_state))
  tr.close()
  return out


@pytest.fixture(scope="module")
def runs():
  """The 3x2 cluster in a thread while this process runs the oracle and the 1x1 runs.

  Alone, each leaves cores idle (XLA compiles a program on one core; the
  hosts wait on each other in collectives); no result depends on timing
  (the balancers see recorded timings).
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    cluster = pool.submit(run_hosts, "_device_batch_entries:cluster", hosts=3,
                          devices_per_host=2, timeout_s=900)
    here = {model: (oracle(model), one_device(model)) for model in ent.MODELS}
    return cluster.result(), here


@pytest.fixture(scope="module")
def cluster(runs):
  return runs[0]


def _assert_close(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("model", ent.MODELS)
def test_device_batches_on_any_split_give_the_oracles_parameters_and_state(runs, model):
  cluster, (want, one) = runs[0], runs[1][model]
  got = cluster[0]["splits"][model]
  for steps in want:  # After the fixed uneven split, then after the balanced one.
    _assert_close(got[steps][0], want[steps][0], f"{model} params after {steps} steps")
    _assert_close(got[steps][1], want[steps][1], f"{model} model state after {steps} steps")
  shares = got["shares"]
  assert all(r["splits"][model]["shares"] == shares for r in cluster)  # Invariant 3.
  assert shares[:ent.FIXED_STEPS] == [ent.UNEVEN] * ent.FIXED_STEPS
  # The balancer moved the split off the fixed one, in whole blocks, by the hosts' speeds.
  assert shares[-1] != ent.UNEVEN and shares[-1][0] > shares[-1][1] > shares[-1][2], shares
  assert all(sum(s) == ent.GLOBAL_BATCH and s[0] % ent.BLOCK == s[1] % ent.BLOCK == 0
             for s in shares)
  # 1 host x 1 device with k = 1, on the same oracle.
  _assert_close(one[0], want[ent.FIXED_STEPS][0], f"{model} 1x1 params")
  _assert_close(one[1], want[ent.FIXED_STEPS][1], f"{model} 1x1 model state")


def test_moving_shares_with_device_batches_compile_nothing_after_the_start(cluster):
  runs = [r["dynamic"] for r in cluster]
  assert all(r["after_start"] == 0 for r in runs), [r["after_start"] for r in runs]
  shares = runs[0]["shares"]
  assert len(shares) == 200 and all(r["shares"] == shares for r in runs)
  assert len(set(shares)) >= 3, sorted(set(shares))  # The balancer did move them.
  assert runs[0]["device_batches"] == list(ent.DEVICE_BATCHES)


def test_a_rounds_local_step_with_device_batches_is_the_one_of_single_blocks():
  from hetjax.modes import rounds
  meshes = mesh.Meshes.create()
  rng = np.random.default_rng(1)
  batch = {"x": rng.standard_normal((26, 5)).astype(np.float32),
           "y": rng.integers(0, 3, 26).astype(np.int32)}
  task, optimizer = _task(), optax.sgd(0.1)
  init = next(step.micro_batches({k: v[:1] for k, v in batch.items()}, 4))
  out = {}
  for k in (1, 4):  # 7 blocks: 7 rounds of one, or 4 + 2 + 1 (the step donates its inputs).
    local = rounds.LocalStep(task, optimizer, meshes, 4, 26, device_batch=k)
    p, ms = jax.jit(task.init, out_shardings=meshes.local_replicated)(jax.random.key(0), init)
    out[k] = jax.device_get(local(p, local.init_opt_state(p), ms, batch, jax.random.key(2), 3, 5))
  for a, b in zip(jax.tree.leaves(out[4]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_fits_the_largest_power_of_two_in_the_memory_fraction():
  from hetjax.step import device_batch

  class Memory:  # What `compiled.memory_analysis()` reports of the one-block program.
    temp_size_in_bytes, output_size_in_bytes = 100, 50

  stats = {"bytes_limit": 10_000, "bytes_in_use": 1_000}
  # 0.8 x 10000 - 1000 - 50 = 6950 bytes for blocks of 100 + 20: 57 fit, 32 is taken.
  assert device_batch.memory_k(stats, Memory, 20, 0.8, cap=64) == 32
  assert device_batch.memory_k(stats, Memory, 20, 0.8, cap=12) == 8  # Never past the cap.
  assert device_batch.memory_k(stats, Memory, 20, 0.1, cap=64) == 1  # Nothing fits: one block.
  assert device_batch.memory_k(None, Memory, 20, 0.8, cap=64) is None  # XLA:CPU reports none.


def test_a_resume_may_run_another_device_batch(tmp_path):
  rng = np.random.default_rng(3)
  source = hetjax.ArraySource({"x": rng.standard_normal((64, 5)).astype(np.float32),
                               "y": rng.integers(0, 3, 64).astype(np.int32)},
                              hetjax.DatasetInfo("points", "image", num_classes=3))
  ckpt = hetjax.CheckpointConfig(str(tmp_path), every=2, async_save=False)
  for k, steps in ((2, 2), (1, 3)):  # Written with k = 2, resumed with k = 1.
    config = hetjax.TrainConfig(global_batch=16, microbatch=4, device_batch=k, check_every=0)
    tr = hetjax.Trainer(_task(), optax.sgd(0.1), source, config, checkpoint=ckpt)
    summary = tr.fit(until=steps)
    tr.close()
    assert summary["device_batches"] == [k]
  assert tr.resumed_from == 2 and summary["last_step"] == 3
