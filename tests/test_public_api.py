"""The public face stays put while the rooms behind it move, and JAX stays out of
the modules that must start fast (the launcher, the balancer, the simulator, the configs)."""

from __future__ import annotations

import subprocess
import sys

import hetjax

# What `import hetjax` offers by name. A change here is a change of the public
# API: update the README and docs with it.
PUBLIC = sorted([
    "ArraySource", "CheckpointConfig", "DatasetInfo", "HostsDisagree", "Interrupted", "MASK",
    "Preempted", "RoundsConfig", "RoundsTrainer", "Stopped", "Task", "TrainConfig", "Trainer",
    "Weighted", "from_functions", "from_linen", "from_nnx", "initialize", "params_digest",
    "topology", "train",
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


def test_the_package_exports_exactly_its_public_names():
  assert sorted(hetjax.__all__) == PUBLIC
  for name in SUBMODULES:
    assert name in dir(hetjax)


def test_public_names_resolve_to_the_objects_their_modules_define():
  from hetjax import config, trainer
  from hetjax.cluster import testing as cluster_testing
  assert hetjax.TrainConfig is config.TrainConfig
  assert hetjax.CheckpointConfig is config.CheckpointConfig
  assert hetjax.RoundsConfig is config.RoundsConfig
  assert hetjax.Trainer is trainer.Trainer
  assert hetjax.testing.run_hosts is cluster_testing.run_hosts
  assert hetjax.checkpoint.CheckpointConfig is config.CheckpointConfig


def test_the_launcher_balancer_simulator_and_configs_load_without_jax():
  modules = ["hetjax.config", "hetjax.balancer", "hetjax.blocks", "hetjax.sim",
             "hetjax.sim.rounds", "hetjax.cluster.procs", "hetjax.cluster.emulate",
             "hetjax.cluster.signals", "hetjax.cluster.hostguard", "hetjax.modes.options",
             "hetjax.observe.report", "hetjax.observe.progress", "hetjax.testing"]
  code = _BLOCK_JAX + "".join(f"import {m}\n" for m in modules) + (
      "import runpy, sys\n"
      "sys.argv = ['launch/local.py', '--help']\n"
      "try:\n  runpy.run_path('launch/local.py', run_name='__main__')\n"
      "except SystemExit as e:\n  assert e.code == 0, e.code\n")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "--hosts" in run.stdout


def test_the_cli_rejects_bad_arguments_before_jax_loads():
  code = _BLOCK_JAX + ("from hetjax import cli\n"
                       "raise SystemExit(cli.main(['train', '--global-batch', '0']))\n")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert run.returncode == 2, run.stderr[-2000:]
  assert "--global-batch must be >= 1, got 0" in run.stderr
