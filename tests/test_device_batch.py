"""Device batches: `k` blocks per device per micro-batch, the math of `k = 1`.

(a) in this process: one `LocalProgram` share run with k = 1, 2 and 4 gives
the same sums on a BatchNorm + Dropout model, with an uneven share and a
partial last block; a Trainer with k > 1 runs programs of k, k/2, ..., 1
blocks (counted where they run); a resume with another k continues the
uninterrupted run; `auto` chooses on a recorded clock; a model with Flax's
fast variance is told at start. (b) on a 3 hosts x 2 devices cluster with
device batches (4, 2, 1): four models, a fixed uneven split and a balanced
one, against an independent `jax.grad` + optax oracle (the exactness
matrix's runs and oracle, one cluster start for both). That moving shares
with device batches compile nothing after the start is
tests/test_cluster.py::test_moving_shares_never_recompiles.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _exact_entries as ex
import hetjax
from hetjax import cli, mesh, step
from hetjax.balancer import ladder
from hetjax.step import local as local_step
from test_exactness import cached_oracle

RTOL, ATOL = 1e-4, 1e-5


def _assert_close(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL,
                               err_msg=f"{what}: {jax.tree_util.keystr(path)}")


class _BatchNormDropout(nn.Module):
  fast_variance: bool = True  # Flax's default; False: the stable variance (docs/model.md).

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Dense(6)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5,
                     use_fast_variance=self.fast_variance)(
        x, mask=None if mask is None else mask[:, None] > 0)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


def _task(fast_variance: bool = True):
  def loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {
        "correct": (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)}
  return hetjax.from_linen(_BatchNormDropout(fast_variance), loss, mask_arg="mask")


def _points(n: int = 64, seed: int = 3) -> hetjax.ArraySource:
  rng = np.random.default_rng(seed)
  return hetjax.ArraySource({"x": rng.standard_normal((n, 5)).astype(np.float32),
                             "y": rng.integers(0, 3, n).astype(np.int32)},
                            hetjax.DatasetInfo("points", "image", num_classes=3))


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
# The exactness matrix's cluster runs with these device batches (conftest.py's
# session fixtures, tests/_exact_entries.py): one cluster start and one oracle
# serve tests/test_exactness.py, tests/test_sharded_update.py and this test.


@pytest.mark.parametrize("model", ex.MODELS)
def test_device_batches_on_any_split_give_the_oracles_parameters_and_state(
    model, exact_one_device, exact_clusters):
  """1x1 with k = 1 and 3x2 with (4, 2, 1): one trainer on the fixed uneven split for 3 steps,
  then on the balanced one.

  The oracle (`test_exactness.oracle_snapshots`) is a plain `jax.grad` +
  optax loop over blocks padded with junk, each block keyed
  `fold_in(fold_in(key(seed), step), block)`: a block key or a mask wrong
  for k > 1 changes hetjax's result and not the oracle's.
  """
  want = cached_oracle(model)[ex.STEPS]
  alone = ex.ONE_DEVICE_REDUCTION[model]
  one = exact_one_device[(model, alone)]
  assert one[4] == [1]
  _assert_close(one[0], want[0], f"1x1 {model} {alone} params")
  _assert_close(one[1], want[1], f"1x1 {model} {alone} model state")
  reduction = ex.CLUSTER_REDUCTION[model]
  results = [host[(model, reduction)] for host in exact_clusters[0]]
  shares = results[0][2]
  for host, result in enumerate(results):
    assert result[4] == list(ex.DEVICE_BATCHES), (host, result[4])
    assert result[2] == shares, host  # Invariant 3: every host runs one split.
    _assert_close(result[0], want[0], f"3x2 host {host} {model} params")
    _assert_close(result[1], want[1], f"3x2 host {host} {model} model state")
  assert all(sum(s) == ex.GLOBAL_BATCH and s[0] % ex.BLOCK == s[1] % ex.BLOCK == 0
             for s in shares), shares
  assert shares[:ex.FIXED_STEPS] == [ex.UNEVEN] * ex.FIXED_STEPS
  # The balancer moved the split off the fixed one, in whole blocks, by the hosts' speeds.
  assert shares[-1] != ex.UNEVEN and shares[-1][0] > shares[-1][2], shares


def test_the_uneven_split_runs_every_hosts_largest_program():
  """Guards the test above: on 3x2 each host's device batch really runs (a k that never runs
  would compare k = 1 with itself)."""
  blocks = [-(-s // ex.BLOCK) for s in ex.UNEVEN]
  programs = [ladder.Ladder.of(2, k).programs(b) for k, b in zip(ex.DEVICE_BATCHES, blocks)]
  assert programs == [{4: 1, 1: 1}, {2: 1, 1: 1}, {1: 1}], programs


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


def _spy_on_local_programs(tr: hetjax.Trainer) -> dict[int, list[int]]:
  """Wraps the trainer's compiled local programs (built by its first steps):
  {blocks per device: the rows of each run}, filled as they run."""
  runs: dict[int, list[int]] = {}

  def spy(j, program):
    def run(*args):
      runs.setdefault(j, []).append(len(args[-2]["x"]))  # (..., micro-batch, key)
      return program(*args)
    return run

  local = tr.mode.local
  assert local._grad and local._update_then_grad, "the first two steps build both kinds"
  local._grad = {j: spy(j, p) for j, p in local._grad.items()}
  local._update_then_grad = {j: spy(j, p) for j, p in local._update_then_grad.items()}
  return runs


def _sgd_trainer(k: int, folder) -> hetjax.Trainer:
  """28 samples a step in blocks of 4 on one device (7 blocks), checkpoints every 2 steps.

  SGD: the bias before BatchNorm has a zero gradient up to rounding, which
  Adam would turn into full steps (see tests/_exact_entries.py).
  """
  config = hetjax.TrainConfig(global_batch=28, microbatch=4, device_batch=k, check_every=0)
  return hetjax.Trainer(_task(fast_variance=False), optax.sgd(0.3), _points(), config,
                        checkpoint=hetjax.CheckpointConfig(str(folder), every=2, async_save=False))


@pytest.fixture(scope="module")
def four_blocks_run(tmp_path_factory):
  """4 uninterrupted steps with k = 4, its local programs counted in steps 3 and 4, its
  checkpoint of step 2 kept: one trainer for the next two tests."""
  import shutil
  folder = tmp_path_factory.mktemp("device-batch-4")
  tr = _sgd_trainer(4, folder / "whole")
  initial = tr.params()
  tr.fit(until=2)
  shutil.copytree(folder / "whole", folder / "step-2")
  runs = _spy_on_local_programs(tr)
  tr.fit(until=4)
  out = {"runs": runs, "initial": initial, "step_2": folder / "step-2",
         "end": (tr.params(), jax.device_get(tr.state.model_state))}
  tr.close()
  return out


def test_a_trainer_with_device_batches_runs_programs_of_k_blocks(four_blocks_run):
  """Counted where they run, not read from the summary (which repeats the configuration):
  7 blocks a step as 4 + 2 + 1 blocks with k = 4 (the ladder the balancer prices), each run
  holding j blocks of 4 rows."""
  runs = four_blocks_run["runs"]
  assert {j: len(rows) for j, rows in runs.items()} == {4: 2, 2: 2, 1: 2}, runs
  assert all(rows == [4 * j] * len(rows) for j, rows in runs.items()), runs


def test_a_ladders_rungs_add_no_traces_of_the_model():
  """k = 4 compiles six block programs (4, 2 and 1 blocks, with and without the update), k = 2
  four; the model's Python runs as often in both (its block forward is traced once alone and
  once stacked, then transformed): a ladder's rungs cost compiles, not model traces."""
  def traces(k: int) -> int:
    calls = []

    def per_example_loss(params, batch, rng):
      del rng
      calls.append(batch["x"].shape)
      logits = batch["x"] @ params["w"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {}

    task = hetjax.from_functions(lambda rng, batch: {"w": jnp.zeros((5, 3))}, per_example_loss)
    config = hetjax.TrainConfig(global_batch=28, microbatch=4, device_batch=k, check_every=0)
    tr = hetjax.Trainer(task, optax.sgd(0.3), _points(), config)
    tr.fit(3)  # Step 2 compiles the programs with the update.
    tr.close()
    return calls.count((4, 5))

  two_rungs, three_rungs = traces(2), traces(4)
  assert two_rungs > 0 and three_rungs == two_rungs, (two_rungs, three_rungs)


def test_a_resume_with_another_device_batch_continues_the_uninterrupted_run(four_blocks_run):
  """The k = 4 run's checkpoint of step 2 resumed with k = 1 for 2 more steps: the k = 4 run's
  parameters and BatchNorm statistics at step 4 (up to float rounding)."""
  tr = _sgd_trainer(1, four_blocks_run["step_2"])
  summary = tr.fit(until=4)
  got = (tr.params(), jax.device_get(tr.state.model_state))
  tr.close()
  assert tr.resumed_from == 2 and summary["device_batches"] == [1]
  want = four_blocks_run["end"]
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # Guards the comparison: the 2 steps after the checkpoint move every kernel past the
  # tolerance, and so would a resume that kept the fresh parameters.
  for layer in ("Dense_0", "Dense_1"):
    assert np.max(np.abs(four_blocks_run["initial"][layer]["kernel"]
                         - want[0][layer]["kernel"])) > 1e-2


def _recorded_clock(run_s: list[float]):
  """A clock that reads as if each timed run took the next of `run_s` seconds (two reads a run)."""
  ticks, now = [], 100.0
  for seconds in run_s:
    ticks += [now, now + seconds]
    now += seconds + 1.0
  ticks = iter(ticks)
  return lambda: next(ticks)


@pytest.mark.parametrize("eight, four, chosen", [
    ([8e-3, 8e-3, 8e-3], [6e-3, 6e-3, 6e-3], 8),    # 1 ms a block at 8 against 1.5 ms at 4.
    ([16e-3, 16e-3, 16e-3], [4e-3, 4e-3, 4e-3], 4),  # 2 ms a block at 8 against 1 ms at 4.
    ([8e-3, 0.5, 8e-3], [6e-3, 6e-3, 6e-3], 8),       # One slow run (a busy machine): the median.
])
def test_auto_keeps_the_device_batch_with_the_shorter_time_per_block(eight, four, chosen):
  """`auto` on XLA:CPU (no memory reported: 8 blocks, then 8 against 4) on a recorded clock:
  the programs compile and run; their times are the recorded ones, not the machine's."""
  from hetjax.step import device_batch
  # A linear model: the programs compile in a moment, and the choice does not look inside.
  task = hetjax.from_functions(lambda rng, b: {"w": jnp.ones((5, 3))},
                               lambda p, b, rng: (jnp.sum((b["x"] @ p["w"]) ** 2, -1), {}))
  example = _points()[np.arange(1)]
  params, state = task.init(None, example)
  # Timed runs alternate k and k/2, three repeats each.
  clock = _recorded_clock([s for pair in zip(eight, four) for s in pair])
  choice = device_batch.choose(task, params, state, example, 4, device=jax.devices()[0], cap=16,
                               clock=clock)
  assert choice.memory_k is None and choice.k == chosen, choice
  assert choice.seconds_per_block == pytest.approx(
      {8: sorted(eight)[1] / 8, 4: sorted(four)[1] / 4})


def _fast_variance_warnings(k: int) -> list[str]:
  """The fast-variance warnings a Trainer with device batch `k` gives at start (nothing runs)."""
  import warnings
  rng = np.random.default_rng(4)
  source = hetjax.ArraySource({"x": rng.standard_normal((32, 5)).astype(np.float32),
                               "y": rng.integers(0, 3, 32).astype(np.int32)},
                              hetjax.DatasetInfo("points", "image", num_classes=3))
  config = hetjax.TrainConfig(global_batch=16, microbatch=4, device_batch=k, check_every=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hetjax.Trainer(_task(), optax.sgd(0.1), source, config).close()
  return [str(w.message) for w in caught if "fast variance" in str(w.message)]


def test_a_user_model_with_flax_fast_variance_is_told_once_at_start_when_k_exceeds_1():
  """Flax's default BatchNorm under device batches: one warning naming the layer and the fix."""
  told = _fast_variance_warnings(2)
  assert len(told) == 1, told
  assert "BatchNorm_0" in told[0] and "use_fast_variance=False" in told[0]
  assert _fast_variance_warnings(1) == []  # One block per program: the kernels do not change.
