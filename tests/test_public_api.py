"""The public face stays put while the rooms behind it move, and JAX stays out of
the modules that must start fast (the launcher, the balancer, the simulator, the configs)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import hetjax

# What `import hetjax` offers by name. A change here is a change of the public
# API: update the README and docs with it.
PUBLIC = sorted([
    "ArraySource", "CheckpointConfig", "DatasetInfo", "Elastic", "HostsDisagree", "Hybrid",
    "Interrupted", "MASK", "Preempted", "Stopped", "Sync", "Task",
    "TrainConfig", "Trainer", "Weighted", "from_functions", "from_linen", "from_nnx",
    "initialize", "params_digest", "topology", "train",
])
SUBMODULES = ["checkpoint", "data", "metrics", "models", "optimizers", "progress", "report",
              "signals", "testing"]

# Run in a fresh interpreter that refuses to import JAX at all.
_BLOCK_JAX = """
import sys
class _NoJax:
  def find_spec(self, name, path=None, target=None):
    if name == "jax" or name.startswith(("jax.", "jaxlib", "flax", "optax", "orbax")):
      raise ImportError(f"{name} imported where JAX must stay out")
sys.meta_path.insert(0, _NoJax())
"""


def _without_jax(code: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter that refuses to import JAX."""
  return subprocess.run([sys.executable, "-c", _BLOCK_JAX + code], capture_output=True,
                        text=True, timeout=120)


def test_the_package_exports_exactly_its_public_names():
  assert sorted(hetjax.__all__) == PUBLIC
  for name in SUBMODULES:
    assert name in dir(hetjax)


def test_public_names_resolve_to_the_objects_their_modules_define():
  from hetjax import config, trainer
  assert hetjax.TrainConfig is config.TrainConfig
  assert hetjax.CheckpointConfig is config.CheckpointConfig
  assert hetjax.Trainer is trainer.Trainer
  assert hetjax.testing.run_hosts.__module__ == "hetjax.testing"
  assert hetjax.checkpoint.CheckpointConfig is config.CheckpointConfig


def test_the_launcher_balancer_simulator_and_configs_load_without_jax():
  modules = ["hetjax.config", "hetjax.balancer", "hetjax.blocks", "hetjax.sim",
             "hetjax.sim.rounds", "hetjax.cluster.procs", "hetjax.cluster.hostgroup",
             "hetjax.cluster.hostenv", "hetjax.cluster.launcher_cli", "hetjax.cluster.emulate",
             "hetjax.cluster.signals", "hetjax.cluster.hostguard", "hetjax.cli.flags",
             "hetjax.observe.report", "hetjax.observe.progress", "hetjax.testing"]
  code = "".join(f"import {m}\n" for m in modules) + (
      "import runpy, sys\n"
      "sys.argv = ['launch/local.py', '--help']\n"
      "try:\n  runpy.run_path('launch/local.py', run_name='__main__')\n"
      "except SystemExit as e:\n  assert e.code == 0, e.code\n")
  run = _without_jax(code)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "--hosts" in run.stdout


def test_the_cli_rejects_bad_arguments_before_jax_loads():
  run = _without_jax("from hetjax import cli\n"
                     "raise SystemExit(cli.main(['train', '--global-batch', '0']))\n")
  assert run.returncode == 2, run.stderr[-2000:]
  assert "--global-batch must be >= 1, got 0" in run.stderr


# The long options of each command, as users type them and the docs name them.
# Removing or renaming a flag breaks every script that passes it: update the
# README, docs/ and this list together.
CLI_FLAGS = {
    "train": [
        "--assignment", "--augment", "--balancer", "--ckpt-dir", "--ckpt-every", "--clip-norm",
        "--config", "--data-dir", "--dataset", "--device-batch", "--elastic-beta",
        "--eval-every", "--global-batch", "--image-size", "--local-batch", "--local-steps",
        "--log-every", "--lr", "--microbatch", "--mode", "--model", "--optimizer", "--out",
        "--outer-lr", "--outer-momentum", "--outer-optimizer", "--precision", "--print-config",
        "--round-steps", "--schedule", "--seq-len", "--shard-within-host", "--steps", "--token-dtype", "--vocab-size",
        "--wandb", "--warmup-steps", "--watchdog", "--weight-decay",
    ],
    "report": [],
    "doctor": [
        "--batch", "--expect-devices", "--gloo-interface", "--init-timeout", "--json", "--model",
        "--steps",
    ],
}


def test_the_cli_flags_are_the_pinned_ones():
  # Read from the parser in a fresh interpreter with JAX blocked: building it must stay cheap.
  code = (
      "import argparse, json\n"
      "from hetjax.cli import flags\n"
      "parser = flags.parser()\n"
      "sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))\n"
      "print(json.dumps({name: sorted(o for a in p._actions for o in a.option_strings\n"
      "                               if o.startswith('--') and o != '--help')\n"
      "                  for name, p in sub.choices.items()}))\n")
  run = _without_jax(code)
  assert run.returncode == 0, run.stderr[-2000:]
  found = json.loads(run.stdout)
  for command in sorted(set(found) | set(CLI_FLAGS)):
    pinned, now = CLI_FLAGS.get(command), found.get(command)
    assert now == pinned, (
        f"`hetjax {command}` flags changed: gone {sorted(set(pinned or []) - set(now or []))}, "
        f"new {sorted(set(now or []) - set(pinned or []))}. A flag is public API: update the "
        f"README and docs/ that name it, then CLI_FLAGS in tests/test_public_api.py.")


def _docs(obj) -> str:
  """A public name's docstring, with its constructor's for a class that has its own."""
  doc = inspect.getdoc(obj) or ""
  if inspect.isclass(obj) and "__init__" in vars(obj):
    doc += "\n" + (inspect.getdoc(obj.__init__) or "")
  return doc


def _takes_arguments(obj) -> bool:
  if inspect.isclass(obj) and issubclass(obj, BaseException):
    return True  # Its message, at least.
  return bool(inspect.signature(obj).parameters)


def test_every_public_name_documents_its_arguments_and_returns_with_an_example():
  missing = []
  for name in hetjax.__all__:
    obj = getattr(hetjax, name)
    if not callable(obj):
      continue  # MASK: a constant, documented where it is defined.
    need = ["Example", ">>>"]
    if _takes_arguments(obj):
      need.append("Args")
    if inspect.isfunction(obj):
      need.append("Returns")
    missing += [f"{name}: no {part}" for part in need if part not in _docs(obj)]
  assert not missing, missing


def test_the_public_examples_run():
  """Every example in a public name's docstring, run as written (one tiny model, a few steps)."""
  import doctest

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  finder = doctest.DocTestFinder(recurse=False)
  ran = 0
  for name in hetjax.__all__:
    obj = getattr(hetjax, name)
    if not callable(obj):
      continue
    globs = {"hetjax": hetjax, "jax": jax, "jnp": jnp, "np": np, "optax": optax}
    for owner in [obj] + ([obj.__init__] if inspect.isclass(obj) and "__init__" in vars(obj) else []):
      for test in finder.find(owner, name, globs=dict(globs)):
        ran += len(test.examples)
        runner.run(test)
  # 47 examples since RoundsTrainer and RoundsConfig left the public names; the floor
  # guards the finder.
  assert runner.failures == 0 and ran > 40, runner.summarize()
