"""Single-process behaviour of the step, the sampler, the split and the API."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import hetjax
from hetjax import models as zoo
from hetjax import balancer, step, trainer
from hetjax.input import data
from hetjax.task import MASK


def test_micro_batches_pad_the_last_one_and_mask_it():
  batch = {"x": np.arange(11.0)}
  parts = list(step.micro_batches(batch, 4))
  assert [p["x"].shape for p in parts] == [(4,), (4,), (4,)]
  np.testing.assert_array_equal(parts[-1][MASK], [1, 1, 1, 0])
  np.testing.assert_array_equal(np.concatenate([p["x"][p[MASK] > 0] for p in parts]), batch["x"])
  assert list(step.micro_batches({"x": np.zeros((0, 3))}, 4)) == []


@pytest.mark.parametrize("shares", [(64,), (5, 23, 36), (0, 30, 34), (64, 0, 0), (10, 10, 10, 34)])
def test_host_slices_rebuild_the_global_batch_across_epochs(shares):
  sampler = data.GlobalSampler(num_records=100, global_batch=64, seed=3)
  for s in range(5):  # 320 samples: crosses three epoch boundaries.
    whole = sampler.indices(s)
    parts = [whole[data.host_slice(shares, h)] for h in range(len(shares))]
    assert [len(p) for p in parts] == list(shares)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_each_epoch_visits_every_record_once():
  sampler = data.GlobalSampler(num_records=96, global_batch=32, seed=0)
  epoch0 = np.concatenate([sampler.indices(s) for s in range(3)])
  epoch1 = np.concatenate([sampler.indices(s) for s in range(3, 6)])
  assert sorted(epoch0) == list(range(96)) == sorted(epoch1)
  assert not np.array_equal(epoch0, epoch1)


def test_equal_split_gives_the_remainder_to_the_first_hosts():
  assert balancer.equal_split(64, 3) == (22, 21, 21)
  assert balancer.equal_split(2, 3) == (1, 1, 0)


@pytest.mark.parametrize("shares, message", [
    ((5, 23), "has 2 entries but the job has 3 hosts"),
    ((-1, 30, 35), "negative share"),
    ((5, 23, 35), "sums to 63 but the global batch is 64"),
])
def test_bad_assignments_are_refused_with_the_reason(shares, message):
  with pytest.raises(ValueError, match=message):
    balancer.make_balancer(shares, 64, 3)


def test_assignment_text_must_be_equal_or_integers():
  assert balancer.parse_assignment("5,23,36") == (5, 23, 36)
  with pytest.raises(ValueError, match="comma-separated integers"):
    balancer.parse_assignment("5;23")


def _trainer(model="mlp", global_batch=12, microbatch=5, opt=None, **kw):
  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build(model, kind="image", num_classes=10, **kw)
  return trainer.Trainer(task, opt or optax.adam(1e-3), source,
                         trainer.TrainConfig(global_batch=global_batch, microbatch=microbatch))


class SmallBatchNormNet(nn.Module):
  """Dense -> masked BatchNorm -> Dense: the step's BatchNorm path, cheap to compile."""

  @nn.compact
  def __call__(self, x, train: bool = False, mask=None):
    x = nn.Dense(16)(x.reshape(x.shape[0], -1))
    x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(
        x, mask=None if mask is None else mask[:, None] > 0)
    return nn.Dense(10)(nn.relu(x))


def _classification(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), {}


def test_batchnorm_running_statistics_are_the_sample_weighted_mean():
  hetjax.initialize()
  tr = trainer.Trainer(hetjax.from_linen(SmallBatchNormNet(), _classification, mask_arg="mask"), optax.sgd(0.0),
                       data.load("digits"), trainer.TrainConfig(global_batch=12, microbatch=5))
  old = jax.device_get(tr.state.model_state)
  params = jax.device_get(tr.state.params)
  host_batch = tr.source[tr.sampler.indices(0)]
  tr.train_step()
  # 12 samples in micro-batches of 5: counts 5, 5 and 2 (3 padded rows).
  expected, counts = None, []
  for part in step.micro_batches(host_batch, 5):
    _, _, new = jax.jit(tr.task.loss)(params, old, part, jax.random.key(0))
    n = float(part[MASK].sum())
    counts.append(n)
    weighted = jax.tree.map(lambda s: np.asarray(s) * n, new)
    expected = weighted if expected is None else jax.tree.map(np.add, expected, weighted)
  assert counts == [5, 5, 2]
  expected = jax.tree.map(lambda s: s / 12, expected)
  got = jax.device_get(tr.state.model_state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(old)))


def test_shares_that_sum_to_zero_are_an_error_not_a_nan():
  tr = _trainer()

  class Nothing:
    name = "nothing"
    def shares(self, step):
      return (0,)
    def observe(self, *args):
      pass

  tr.mode.balancer = Nothing()
  with pytest.raises(ValueError, match="sums to 0 but the global batch is 12"):
    tr.train_step()


def test_summary_has_the_documented_fields():
  tr = _trainer(global_batch=16, microbatch=4)
  summary = tr.fit(3)
  assert summary["steps"] == 3 and summary["hosts"] == 1 and summary["global_batch"] == 16
  assert summary["per_host"][0]["batch"] == [16, 16, 16]
  assert len(summary["per_host"][0]["compute_s"]) == len(summary["per_host"][0]["wait_s"]) == 3
  assert summary["params_digest"] is None  # Hashing every parameter is on request only.
  assert tr.summary(digest=True)["params_digest"] == trainer.params_digest(tr.params())
  assert np.isfinite(summary["final_loss"]) and summary["samples_per_sec"] > 0


def test_nnx_and_linen_modules_train_through_the_adapters():
  from flax import nnx

  loss = _classification

  class Linen(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
      x = nn.Dense(32)(x.reshape(x.shape[0], -1))
      x = nn.BatchNorm(use_running_average=not train)(x)
      return nn.Dense(10)(nn.relu(x))

  class Nnx(nnx.Module):
    def __init__(self, rngs):
      self.l1, self.l2 = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)
    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x.reshape(x.shape[0], -1))))

  hetjax.initialize()
  for task in (hetjax.from_linen(Linen(), loss), hetjax.from_nnx(Nnx(nnx.Rngs(0)), loss)):
    tr = hetjax.Trainer(task, optax.adam(1e-2), data.load("digits"), hetjax.TrainConfig(global_batch=64))
    tr.fit(25)
    assert tr.history.loss[-1] < 0.5 * tr.history.loss[0]


def test_a_dataset_smaller_than_one_global_batch_is_refused():
  hetjax.initialize()
  source = data.ArraySource({"x": np.zeros((10, 2), np.float32)})
  task = hetjax.from_functions(lambda rng, b: {"w": jnp.zeros(2)}, lambda p, b, r: (b["x"] @ p["w"], {}))
  # The API names its fields (the command line's words are the CLI's).
  with pytest.raises(ValueError, match="fewer than one global batch .*; lower `global_batch`"):
    hetjax.Trainer(task, optax.sgd(0.1), source, hetjax.TrainConfig(global_batch=11))


def test_records_whose_shapes_disagree_are_refused_before_anything_compiles():
  hetjax.initialize()

  class Ragged:
    """The last record is 4x4 where the others are 8x8, as a badly prepared dataset might be."""
    info = data.DatasetInfo("ragged", "image", num_classes=10)

    def __len__(self):
      return 100

    def __getitem__(self, indices):
      side = 4 if 99 in indices else 8
      n = len(indices)
      return {"x": np.zeros((n, side, side, 1), np.float32), "y": np.zeros(n, np.int32)}

  task = zoo.build("mlp", kind="image", num_classes=10)
  with pytest.raises(ValueError, match="ragged"):
    hetjax.Trainer(task, optax.sgd(0.1), Ragged(), hetjax.TrainConfig(global_batch=16))


def test_the_package_lists_its_public_names_and_loads_submodules_as_the_readme_writes():
  import subprocess
  import sys
  code = ("import hetjax, sys; names = dir(hetjax); "
          "assert 'jax' not in sys.modules, 'a plain import must not load JAX'; "
          "print(callable(hetjax.testing.run_hosts), callable(hetjax.metrics.MetricsWriter)); "
          "print(' '.join(n for n in names if not n.startswith('_')))")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  first, names = run.stdout.splitlines()
  assert first == "True True"
  for name in ("Trainer", "TrainConfig", "from_linen", "Preempted", "Interrupted", "testing",
               "metrics", "initialize", "CheckpointConfig"):
    assert name in names.split()
