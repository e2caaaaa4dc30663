"""Rounds modes under failure: kill -9 of one host mid-run, restart, SIGTERM, resume: the uninterrupted centre."""

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
from hetjax.config import RoundsConfig
from hetjax.modes import from_config
from hetjax.testing import run_hosts

from _warm_client import module_command

import _cli_job
import _fault_job


def _hybrid(ckpt: str) -> trainer.Trainer:
  """The trainer of `_modes_entries.resume(ckpt, "hybrid", ...)` on this host's layout."""
  if not runtime.is_initialized():
    hetjax.initialize()
  config = trainer.TrainConfig(global_batch=24, microbatch=_modes_entries.BLOCK, seed=2)
  return trainer.Trainer(_modes_entries._tiny(), optax.sgd(0.05, momentum=0.9),
                         data.load("digits"), config, checkpoint=checkpoint.CheckpointConfig(
                             ckpt, every=2), mode=from_config(RoundsConfig(
                                 mode="hybrid", local_steps=None, outer_lr=0.5)))


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
  assert int(one.mode.centre.round) == 8 and all(_nonzero(one.mode.centre.opt_state))
  # ... and the inner state restarts from the centre: a fresh inner momentum
  # (the 2-host rows saved theirs, non-zero after 8 rounds, in another
  # shape), and the next round's parameters are the centre's.
  momentum = one.mode.host_opt_state[0]  # The optax state; the loss scale sits beside it.
  assert _nonzero(momentum) == [False] * len(jax.tree.leaves(momentum))
  start, _ = one.mode.start(one.mode.centre, one.mode.host_params, one.mode.host_model_state)
  jax.tree.map(np.testing.assert_array_equal, start, one.mode.centre.params)
  one.fit(until=10)
  assert one.step == 10
  one.close()


def _checkpoints(ckpt):
  return [] if ckpt is None else ["--ckpt-dir", str(ckpt), "--ckpt-every", "20"]


def _launch(ckpt, out, extra=()):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return [sys.executable, os.path.join(root, "launch", "local.py"), "--hosts", "2", *extra, "--",
          *module_command("hetjax.cli"), "train", "--model", "mlp", "--mode", "elastic",
          "--local-steps", "2,1", "--optimizer", "momentum", "--lr", "0.05",
          "--global-batch", "32", "--microbatch", "4", "--steps", "100", *_checkpoints(ckpt),
          "--out", str(out), "--log-every", "0"]


def test_elastic_killed_then_stopped_resumes_to_the_uninterrupted_centre(tmp_path):
  """Per-host parameters and inner (momentum) state are checkpointed: kill -9 of host 1, the
  restart, then SIGTERM to every host (each saves, exits 75, the job resumes) end where an
  uninterrupted run does, bit for bit."""
  ref_log = str(tmp_path / "ref.log")
  ref = _fault_job.reference(_launch(None, tmp_path / "ref"), ref_log)
  ckpt, out = tmp_path / "ckpt", tmp_path / "run"
  command = _launch(ckpt, out)[_launch(ckpt, out).index("--") + 1:]
  command[command.index("--log-every") + 1] = "1"  # Host 0's round lines drive the test.
  job = _cli_job.Job(["--max-restarts", "1", "--max-preemptions", "1"], command)
  try:
    first, second, saved = _fault_job.kill_then_stop(job, ckpt, killed=1, stopped=[0, 1],
                                                     steps_after_resume=2)
  finally:
    job.kill()
  _fault_job.finish_reference(ref, ref_log)
  text = job.text()
  assert "resumed elastic from" in text and first >= 20 and first % 20 == 0, text[-3000:]
  assert saved == {0: second, 1: second} and second > first, text[-3000:]  # 75 on every host.
  summary, expected = _fault_job.summary(out), _fault_job.summary(tmp_path / "ref")
  assert summary["mode"] == "elastic" and summary["last_step"] == 100
  assert summary["resumed_from"] == second
  assert summary["params_digest"] == expected["params_digest"]
