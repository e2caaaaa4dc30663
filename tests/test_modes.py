"""The rounds modes (hybrid, elastic): exactness against sync, accuracy, taus, bad input."""

import argparse

import jax
import numpy as np
import pytest

import _modes_entries  # noqa: F401  (importable by the hosts)
from hetjax.observe import report
from hetjax.cli import flags
from hetjax.modes import rounds
from hetjax.testing import run_hosts


def test_hybrid_with_one_local_step_is_sync_on_both_backends():
  """1 local step per host, SGD inside, outer SGD lr 1 == sync with the equal split (3 hosts x 2 devices)."""
  out = run_hosts("_modes_entries:degenerate", hosts=3, devices_per_host=2,
                  args=(3, 48, 0.5), timeout_s=600)
  for host in out:
    for reduction in ("device", "host"):
      got = host[reduction]
      assert got["positions"][0] == got["positions"][1]
      # Every host's timings came back through the reduction (host rows placed right).
      assert all(len(c) == 3 and min(c) > 0 for c in got["compute_s"])
      leaves = jax.tree_util.tree_leaves_with_path(got["sync"])
      for (path, want), have, start in zip(leaves, jax.tree.leaves(got["hybrid"]),
                                           jax.tree.leaves(got["initial"])):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{reduction} {jax.tree_util.keystr(path)}")
        assert np.abs(want - start).max() > 1e-4  # Training moved every leaf.


def test_hybrid_and_elastic_reach_97_percent_on_uneven_hosts_and_record_rounds(tmp_path):
  """3 hosts running 4, 2 and 1 local steps per round (fixed: deterministic); one cluster start for:

  the centre's test accuracy of both modes; the recorded spread is each
  host's distance to the hosts' sample-weighted mean (checked against the
  hosts' gathered parameters); `hetjax report` draws the hybrid run's
  rounds; the elastic run's hosts agree at every check (every 35 rounds),
  and a host whose centre then differs is caught (that run's trainer, not
  one more compiled for the check).
  Accuracy on the 360 test digits, measured: hybrid 0.953 at 40 rounds,
  0.972 at 60, 0.981 at 80; elastic 0.969 at 120, 0.983 at 140, 0.981 at 160.
  """
  out_dir = str(tmp_path / "hybrid")
  # Hybrid's outer step: nesterov 0.7, 0.9. Elastic: default beta 0.9, inner momentum 0.9.
  hybrid = (("hybrid", 80, (4, 2, 1), 0.1), {"momentum": None, "out": out_dir})
  elastic = (("elastic", 140, (4, 2, 1), 0.05), {"check": True})
  out = run_hosts("_modes_entries:accuracies", hosts=3, args=([hybrid, elastic],), timeout_s=600)
  for host in out:
    for result in host["runs"]:
      assert result["taus"] == [4, 2, 1] and result["samples"] == [64, 32, 16]
      assert result["accuracy"] >= 0.97, result
    check = host["runs"][1]["check"]
    assert "host(s) [1] hold other centres" in check, check
  runs = [host["runs"] for host in out]
  for field in ("accuracy", "digest", "spread"):
    assert [r[0][field] for r in runs] == [runs[0][0][field]] * 3  # Every host holds one record.

  got = runs[0][0]
  x = np.asarray(got["host_params"], np.float64)            # [hosts, parameters]
  n = np.asarray(got["samples"], np.float64)
  mean = (n[:, None] * x).sum(0) / n.sum()
  want = np.linalg.norm(x - mean, axis=1)
  np.testing.assert_allclose(got["spread"], want, rtol=1e-4)
  plain = np.linalg.norm(x - x.mean(0), axis=1)
  assert np.abs(np.asarray(got["spread"]) - plain).max() > 1e-3 * want.max()  # Weighted, not plain.

  fig, text = report.make_report(out_dir)
  assert fig.rounds is not None and fig.rounds.mode == "hybrid"
  assert fig.rounds.last_taus == [4, 2, 1] and fig.rounds.samples_per_round == [64.0, 32.0, 16.0]
  np.testing.assert_allclose(fig.rounds.last_spread, got["spread"], rtol=1e-6)
  assert "80 rounds" in text and "hybrid" in text and "spread" in text
  assert (tmp_path / "hybrid" / "report.png").stat().st_size > 10_000


def test_a_mode_flag_for_another_mode_fails_before_jax_starts(capsys):
  from hetjax import cli
  assert cli.main(["train", "--mode", "sync", "--local-steps", "1,1"]) == 2
  assert "--local-steps does not apply to --mode sync" in capsys.readouterr().err
  assert cli.main(["train", "--mode", "elastic", "--elastic-beta", "2"]) == 2
  assert "--elastic-beta must be in (0, 1]" in capsys.readouterr().err


def test_taus_from_speeds_follow_the_hosts_speeds():
  assert rounds.taus_from_speeds(8, [0.1, 0.2, 0.4]) == (8, 4, 2)
  assert rounds.taus_from_speeds(4, [0.1, 0.2, 10.0]) == (4, 2, 1)  # never below 1
  policy = rounds.TauPolicy(4, 3)
  assert policy.taus(0) == (1, 1, 1)          # warm-up
  policy.observe(0, [9.0, 9.0, 9.0])          # round 0 (compilation) is not measured
  policy.observe(1, [0.1, 0.2, 0.4])
  assert policy.taus(2) == (4, 2, 1)
  state = policy.state_dict()
  other = rounds.TauPolicy(4, 3)
  other.load_state_dict(state)
  assert other.taus(2) == (4, 2, 1)
  assert rounds.TauPolicy(4, 3, fixed=(3, 2, 1)).taus(0) == (3, 2, 1)


def test_round_data_is_contiguous_slices_of_the_global_stream():
  plan = rounds.RoundData(start=100, taus=(3, 2, 1), local_batch=10, block=4)
  assert plan.size == 60 and plan.samples() == (30, 20, 10)
  got = np.concatenate([plan.host_positions(h) for h in range(3)])
  np.testing.assert_array_equal(got, np.arange(100, 160))
  # 3 blocks per local step of 10 (the last one partial): host 1's local step 1 is the 5th step.
  assert plan.first_block(1, 1) == 4 * 3


def _args(**kw):
  p = argparse.ArgumentParser()
  p.add_argument("--global-batch", type=int, default=48)
  p.add_argument("--balancer", default=None)
  p.add_argument("--assignment", default="equal")
  flags.add_mode_arguments(p)
  argv = []
  for k, v in kw.items():
    argv += [f"--{k.replace('_', '-')}", str(v)]
  return p.parse_args(argv)


@pytest.mark.parametrize("kw, message", [
    ({"mode": "sync", "round_steps": 4}, "--round-steps does not apply to --mode sync"),
    ({"mode": "hybrid", "elastic_beta": 0.5}, "--elastic-beta does not apply to --mode hybrid"),
    ({"mode": "elastic", "outer_lr": 0.5}, "--outer-lr does not apply to --mode elastic"),
    ({"mode": "hybrid", "round_steps": 0}, "--round-steps must be >= 1"),
    ({"mode": "hybrid", "local_steps": "4,2"}, "gives 2 count(s) for 3 host(s)"),
    ({"mode": "hybrid", "local_steps": "4,x,1"}, "comma-separated whole numbers"),
    ({"mode": "hybrid", "local_steps": "4,0,1"}, ">= 1 local step"),
    ({"mode": "elastic", "elastic_beta": 0.0}, "--elastic-beta must be in (0, 1]"),
    ({"mode": "elastic", "elastic_beta": 1.5}, "--elastic-beta must be in (0, 1]"),
    ({"mode": "hybrid", "outer_optimizer": "adam"}, "unknown --outer-optimizer 'adam'"),
    ({"mode": "hybrid", "outer_momentum": 1.0}, "--outer-momentum must be in [0, 1)"),
    ({"mode": "hybrid", "balancer": "dynamic"}, "--balancer does not apply to --mode hybrid"),
    ({"mode": "hybrid", "local_batch": 0}, "--local-batch must be >= 1"),
])
def test_bad_mode_flags_are_refused_before_anything_starts(kw, message):
  with pytest.raises(ValueError) as e:
    flags.rounds_config(_args(**kw), num_hosts=3)
  assert message in str(e.value)


def test_mode_flags_make_the_config():
  config = flags.rounds_config(_args(mode="hybrid", local_steps="4,2,1", outer_lr=0.5), num_hosts=3)
  assert config.local_steps == (4, 2, 1) and config.outer_lr == 0.5
  assert config.outer_optimizer == "nesterov" and config.local_batch_for(48, 3) == 16
  assert flags.rounds_config(_args(mode="sync"), num_hosts=3) is None


def test_spread_is_each_hosts_distance_to_the_hosts_mean_in_both_modes():
  """Three hosts' known parameters of a tiny two-leaf model, summed as each mode's reduction sums them."""
  import optax
  import hetjax
  from hetjax import mesh as mesh_lib
  from hetjax.modes import elastic, hybrid

  hetjax.initialize()
  meshes = mesh_lib.Meshes.create()
  rng = np.random.default_rng(0)
  tree = lambda: {"b": rng.normal(size=2).astype(np.float32),
                  "w": rng.normal(size=(3, 2)).astype(np.float32)}
  x, centre, n = [tree(), tree(), tree()], tree(), [64, 32, 16]
  flat = lambda t: np.concatenate([np.ravel(t["b"]), np.ravel(t["w"])]).astype(np.float64)
  mean = sum(k * flat(t) for k, t in zip(n, x)) / sum(n)
  want = [np.linalg.norm(flat(t) - mean) for t in x]
  local = lambda t: jax.device_put(t, meshes.local_replicated)
  world = lambda t: jax.device_put(t, meshes.replicated)
  total = lambda trees: jax.tree.map(lambda *v: sum(v), *trees)

  mode = hybrid.Hybrid()
  mode.compile(meshes, optax.sgd(1.0))
  mine = [{"delta": jax.tree.map(lambda c, p: k * (c - p), centre, t)} for k, t in zip(n, x)]
  got = [float(mode.spread(local(m), world(total(mine)), k, sum(n))) for m, k in zip(mine, n)]
  np.testing.assert_allclose(got, want, rtol=1e-5)

  mode = elastic.Elastic(0.9)
  mode.compile(meshes)
  mine = [{"d": jax.tree.map(lambda p, c: mode.alpha(k, sum(n)) * (p - c), t, centre)}
          for k, t in zip(n, x)]
  got = [float(mode.spread(local(m), world(total(mine)), k, sum(n))) for m, k in zip(mine, n)]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  to_centre = [np.linalg.norm(flat(t) - flat(centre)) for t in x]
  assert np.abs(np.array(to_centre) - want).min() > 0.1  # Not the distance to the centre.


def test_bf16_and_fp16_local_steps_train_and_fp16_skips_a_hosts_overflowing_step():
  import optax
  import hetjax
  from hetjax import models as zoo
  from hetjax import trainer
  from hetjax.step import precision as precision_lib
  from hetjax.input import data
  from hetjax.config import RoundsConfig
  from hetjax.modes import from_config

  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(16,))
  settings = RoundsConfig(mode="hybrid", local_steps=(2,), outer_optimizer="sgd", outer_lr=1.0,
                          outer_momentum=0.0)
  runs, big = {}, 2.0 ** 20  # Large enough that the first local step's fp16 gradients overflow.
  for precision in ("fp32", "bf16", "fp16"):
    tr = trainer.Trainer(task, optax.sgd(0.5), source,
                         trainer.TrainConfig(global_batch=32, microbatch=8, precision=precision),
                         mode=from_config(settings))
    if precision == "fp16":
      inner, _ = tr.mode.host_opt_state
      tr.mode.host_opt_state = (inner, jax.device_put(
          precision_lib.LossScale(np.float32(big), np.int32(0)), tr.meshes.local_replicated))
    tr.fit(8)
    runs[precision] = (tr.history, tr.params(), tr.mode.host_opt_state[1])
  (fp32, p32, _), (bf16, p16, _), (fp16, ph, scale) = runs["fp32"], runs["bf16"], runs["fp16"]
  for params in (p16, ph):
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(params))  # Master copy.
  assert bf16.loss[-1] < 0.85 * bf16.loss[0], bf16.loss  # It trains...
  np.testing.assert_allclose(bf16.loss, fp32.loss, rtol=0.05)  # ...as fp32 does,
  diff = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(p32)))
  assert diff > 1e-4  # and its forward pass did run in bf16.
  skipped = [m["skipped"] for m in fp16.metrics]
  assert skipped[0] >= 1 and sum(skipped) < 16, skipped  # Overflowing steps skipped, then it trains.
  assert float(scale.scale.addressable_data(0)) == big / 2 ** sum(skipped)  # Halved once per skip.
  assert fp16.loss[-1] < 0.95 * fp16.loss[0], fp16.loss  # Fewer real steps than bf16 took.
  assert "skipped" not in bf16.metrics[0]
