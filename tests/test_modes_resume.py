"""Rounds modes under failure: kill -9 of one host mid-run, restart, the uninterrupted centre."""

import os
import sys

import jax
import numpy as np
import optax

import _modes_entries
import hetjax
from hetjax import trainer
from hetjax.checkpoint import manager as checkpoint
from hetjax.cluster import runtime
from hetjax.input import data
from hetjax.modes import RoundsConfig
from hetjax.modes.rounds_trainer import RoundsTrainer
from hetjax.testing import killed_and_uninterrupted, run_hosts


def _hybrid(ckpt: str) -> RoundsTrainer:
  """The trainer of `_modes_entries.resume(ckpt, "hybrid", ...)` on this host's layout."""
  if not runtime.is_initialized():
    hetjax.initialize()
  config = trainer.TrainConfig(global_batch=24, microbatch=_modes_entries.BLOCK, seed=2)
  return RoundsTrainer(_modes_entries._tiny(), optax.sgd(0.05, momentum=0.9), data.load("digits"),
                       config, RoundsConfig(mode="hybrid", local_steps=None, outer_lr=0.5),
                       checkpoint=checkpoint.CheckpointConfig(ckpt, every=2))


def _nonzero(tree) -> list[bool]:
  return [bool(np.any(np.asarray(x))) for x in jax.tree.leaves(tree)]


def test_hybrid_resumes_exactly_and_on_another_layout_restarts_hosts_from_the_centre(tmp_path, capfd):
  """Outer Nesterov state, inner momentum, cursor: a resumed hybrid run ends where an unbroken one does."""
  ckpt = str(tmp_path / "ckpt")
  out = run_hosts("_modes_entries:resume", hosts=2, args=(ckpt, "hybrid", 8, (2, 1), 4),
                  timeout_s=600)
  for host in out:
    assert host["resumed_from"] == 4
    assert host["resumed"] == out[0]["reference"]
    assert host["position"] == 8 * 3 * 12  # 8 rounds of (2 + 1) local steps of 24 / 2 samples.
  capfd.readouterr()
  one = _hybrid(ckpt)  # One host, one device: in this process; resumed when built.
  assert (jax.process_count(), jax.local_device_count()) == (1, 1)
  assert one.resumed_from == 8
  assert "another layout: every host's inner state restarts from the centre" in capfd.readouterr().out
  # The centre and its outer (Nesterov) state come from the 2-host checkpoint ...
  assert int(one.centre.round) == 8 and all(_nonzero(one.centre.opt_state))
  # ... and the inner state restarts from the centre: a fresh inner momentum
  # (the 2-host rows saved theirs, non-zero after 8 rounds, in another
  # shape), and the next round's parameters are the centre's.
  momentum = one.host_opt_state[0]  # The optax state; the loss scale sits beside it.
  assert _nonzero(momentum) == [False] * len(jax.tree.leaves(momentum))
  start, _ = one.mode.start(one.centre, one.host_params, one.host_model_state)
  jax.tree.map(np.testing.assert_array_equal, start, one.centre.params)
  one.fit(until=10)
  assert one.round == 10
  one.close()


def _checkpoints(ckpt):
  return [] if ckpt is None else ["--ckpt-dir", str(ckpt), "--ckpt-every", "20"]


def _launch(ckpt, out, extra=()):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return [sys.executable, os.path.join(root, "launch", "local.py"), "--hosts", "2", *extra, "--",
          sys.executable, "-m", "hetjax.cli", "train", "--model", "mlp", "--mode", "elastic",
          "--local-steps", "2,1", "--optimizer", "momentum", "--lr", "0.05",
          "--global-batch", "32", "--microbatch", "4", "--steps", "100", *_checkpoints(ckpt),
          "--out", str(out), "--log-every", "0"]


def test_elastic_host_killed_mid_round_resumes_to_the_uninterrupted_centre(tmp_path):
  """Per-host parameters and inner (momentum) state are checkpointed: the restart is exact."""
  run, summary, expected = killed_and_uninterrupted(_launch, tmp_path, hosts=2)
  assert "resumed elastic from" in run.stdout
  assert summary["mode"] == "elastic" and summary["last_step"] == 100
  assert summary["resumed_from"] is not None and summary["resumed_from"] % 20 == 0
  assert summary["params_digest"] == expected["params_digest"], f"seed {run.seed}"