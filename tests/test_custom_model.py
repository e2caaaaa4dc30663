"""Your own model and data on the command line (`--model / --dataset package.module:factory`).

The CLI on 1 host and on 3 uneven emulated hosts reaches the parameters the
script-based example (examples/custom_model.py) reaches; the run's written
config.yaml re-runs to the same parameters; the NNX / linen example trains
and gives its trained model back.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import hetjax
from hetjax import cli
from _warm_client import module_command

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["--model", "examples.custom_model:task", "--dataset", "examples.custom_model:dataset",
         "--optimizer", "adam", "--lr", "1e-3", "--global-batch", "64", "--microbatch", "8",
         "--steps", "6", "--log-every", "0"]


@pytest.fixture(autouse=True)
def _from_the_checkout(monkeypatch):
  monkeypatch.chdir(ROOT)  # `examples.custom_model` is found from the current folder.


def _script_params(steps: int) -> list[np.ndarray]:
  """What examples/custom_model.py's main() trains, on this one host."""
  from examples import custom_model
  train_source, _ = custom_model.dataset()
  trainer = hetjax.Trainer(custom_model.task(), optax.adam(1e-3), train_source,
                           hetjax.TrainConfig(global_batch=64, microbatch=8))
  trainer.fit(steps=steps)
  params = jax.tree.leaves(trainer.params())
  trainer.close()
  return params


def _save_to(path: pathlib.Path) -> str:
  """A config file whose `save-params` (a key without a flag) is `path`."""
  config = path.with_suffix(".yaml")
  config.write_text(f"save-params: {path}\n")
  return str(config)


def _saved(path) -> list[np.ndarray]:
  saved = np.load(path)
  return [saved[k] for k in saved]  # In tree order, as jax.tree.leaves gives them.


def _assert_same(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    # adam vs the CLI's inject_hyperparams(adam): the same update up to float rounding.
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cli_custom_model_on_one_and_three_uneven_hosts_matches_the_script(tmp_path):
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  three = subprocess.Popen(  # Beside the one-host runs: independent processes, one wall time.
      [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3", "--speeds",
       "1,0.5,0.25", "--", *module_command("hetjax.cli"), "train", *FLAGS,
       "--assignment", "8,24,32", "--out", str(tmp_path / "three"),
       "--config", _save_to(tmp_path / "three.npz")],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    want = _script_params(6)
    one = tmp_path / "one"
    assert cli.main(["train", *FLAGS, "--out", str(one), "--config",
                     _save_to(tmp_path / "one.npz")]) == 0
    _assert_same(_saved(tmp_path / "one.npz"), want)
    # The written config.yaml runs the same job again.
    assert cli.main(["train", "--config", str(one / "config.yaml"),
                     "--out", str(tmp_path / "again")]) == 0
    digest = lambda run: json.loads((run / "summary.json").read_text())["params_digest"]
    assert digest(tmp_path / "again") == digest(one)
    out, _ = three.communicate(timeout=300)
  finally:
    if three.poll() is None:
      three.kill()
      three.wait()
  assert three.returncode == 0, out[-3000:]
  assert json.loads((tmp_path / "three" / "summary.json").read_text())["per_host"][2]["batch"][-1] == 32
  _assert_same(_saved(tmp_path / "three.npz"), want)


@pytest.mark.parametrize("flags, message", [
    (["--model", "examples.custom_model:nothing"], "module 'examples.custom_model' has no 'nothing'"),
    (["--model", "no_such_pkg.mod:task"], "cannot import module 'no_such_pkg.mod'"),
    (["--model", "examples.custom_model:task", "--config", "tests/data/model_width_8.yaml"],
     "`model-width` was given but --model examples.custom_model:task takes no 'width'"),
    (["--dataset", "examples.custom_model:nope"], "has no 'nope'"),
])
def test_a_bad_factory_fails_before_jax_starts(capsys, flags, message):
  assert cli.main(["train", *FLAGS, *flags, "--out", "unused"]) == 2
  assert message in capsys.readouterr().err


def test_nnx_and_linen_examples_train_and_give_the_model_back():
  from flax import nnx
  from examples import flax_models
  model, summary = flax_models.train_nnx(steps=4)
  assert summary["steps"] == 4
  bn = nnx.state(model.bn, nnx.BatchStat)
  assert float(np.abs(np.asarray(bn["mean"][...])).sum()) > 0, "BatchNorm statistics came back"
  fresh = flax_models.NnxNet(rngs=nnx.Rngs(params=0, dropout=1))
  assert not np.allclose(np.asarray(model.head.kernel[...]), np.asarray(fresh.head.kernel[...]))
  model.eval()
  assert np.isfinite(np.asarray(model(np.zeros((2, 8, 8, 1), np.float32)))).all()
  variables, summary = flax_models.train_linen(steps=4)
  assert set(variables) == {"params", "batch_stats"}
  logits = flax_models.LinenNet().apply(variables, np.zeros((2, 8, 8, 1), np.float32))
  assert logits.shape == (2, 10)
