"""Multi-host behaviour on emulated CPU clusters (one process per host, gloo)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from hetjax.testing import run_hosts

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_host_with_share_zero_joins_and_changes_nothing():
  ref, _ = run_hosts("_cluster_entries:train_params", hosts=1, args=("mlp", "equal", "device"))[0]
  results = run_hosts("_cluster_entries:train_params", hosts=3, args=("mlp", (0, 32, 32), "device"))
  for params, summary in results:
    _close(params, ref)
    assert summary["per_host"][0]["batch"] == [0] * 10


def test_moving_shares_never_recompiles():
  results = run_hosts("_cluster_entries:compiles_while_shares_move", hosts=3)
  for r in results:
    assert r["after_warmup"] == 0
    assert r["shares"][2:] == [(4, 0, 60), (64, 0, 0), (4, 24, 36), (32, 0, 32), (4, 0, 60), (64, 0, 0)]
  _close(results[0]["params"], results[2]["params"])


def test_hosts_with_different_configurations_refuse_to_train():
  messages = run_hosts("_cluster_entries:mismatched_config", hosts=2)
  assert all(m is not None and "host(s) [1]" in m and "same command" in m for m in messages)


def test_readme_example_gives_the_same_parameters_on_one_and_three_uneven_hosts(tmp_path):
  example = ROOT / "examples" / "custom_model.py"
  assert example.read_text() in (ROOT / "README.md").read_text(), "README must show the example"
  one, three = tmp_path / "one.npz", tmp_path / "three.npz"
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  subprocess.run([sys.executable, str(example), "--out", str(one)], check=True, env=env, timeout=300)
  run = subprocess.run(
      [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3", "--speeds", "1,0.5,0.25",
       "--", sys.executable, str(example), "--assignment", "8,24,32", "--out", str(three)],
      env=env, timeout=300, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "shares [8, 24, 32]" in run.stdout
  a, b = np.load(one), np.load(three)
  assert list(a) == list(b)
  for k in a:
    np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_the_demo_command_writes_the_summary_contract(tmp_path):
  out = tmp_path / "run"
  # The README demo's flags, shortened: emulated devices, a slowdown, the dynamic balancer.
  cmd = [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3", "--devices-per-host", "1",
         "--speeds", "1,0.5,0.25", "--device-sample-ms", "0.5", "--slowdown", "0:3@8", "--",
         sys.executable, "-m", "hetjax.cli", "train", "--model", "mlp", "--dataset", "digits",
         "--global-batch", "48", "--steps", "10", "--balancer", "dynamic", "--microbatch", "4",
         "--out", str(out), "--save-params", str(tmp_path / "p.npz")]
  run = subprocess.run(cmd, timeout=300, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  for key in ("steps", "global_batch", "hosts", "samples_per_sec", "final_loss", "params_digest"):
    assert key in summary
  assert (summary["steps"], summary["global_batch"], summary["hosts"]) == (10, 48, 3)
  shares = list(zip(*(h["batch"] for h in summary["per_host"])))
  assert shares[0] == (16, 16, 16) and all(sum(s) == 48 for s in shares)
  assert all(len(h["compute_s"]) == len(h["wait_s"]) == 10 for h in summary["per_host"])
  assert summary["emulated_speeds"] is True and summary["balancer_mode"] == "dynamic"
  assert summary["balancer_decisions"][0]["reason"] == "warm-up: equal split"
  assert len(np.load(tmp_path / "p.npz").files) > 0
