"""`hetjax train`: every bad input is refused with a clear error before anything compiles."""

import re

import jax
import numpy as np
import pytest

from hetjax import cli
from hetjax.cluster import runtime
from _warm_client import module_command

BASE = ["train", "--model", "mlp", "--dataset", "digits", "--steps", "2", "--out", "unused"]


@pytest.fixture
def compiles():
  """Backend compilations during the test; afterwards, the listener must hear a new one."""
  events = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: events.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  yield events
  heard = len(events)
  jax.jit(lambda x: x * 3 + 1)(jax.numpy.float32(2))  # A new function: a new program.
  assert len(events) > heard, "the listener hears no compilation: `compiles == []` proves nothing"


@pytest.mark.parametrize("extra, message", [
    (["--global-batch", "0"], "--global-batch must be >= 1, got 0"),
    (["--microbatch", "0"], "--microbatch must be >= 1, got 0"),
    (["--model", "vgg"], "unknown model 'vgg'; choose one of mlp, cnn, resnet18, transformer"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--assignment", "5,23,36"], "has 3 entries but the job has 1 hosts"),
    (["--assignment=-1,65"], "has 2 entries"),
    (["--assignment", "63"], "sums to 63 but the global batch is 64"),
    (["--assignment=-64"], "negative share"),
    (["--assignment", "half"], "'equal' or comma-separated integers"),
    (["--global-batch", "5000"], "fewer than one global batch (5000); lower --global-batch"),
    (["--model", "transformer"], "model 'transformer' needs token data"),
    (["--augment", "rotate"], "rotate"),
    (["--ckpt-dir", "/tmp/hetjax-cli-test", "--ckpt-every", "0"], "--ckpt-every"),
    (["--dataset", "tfds:no_such_dataset", "--data-dir", "/nonexistent-hetjax"], "no_such_dataset"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["--schedule", "cosine", "--warmup-steps", "2"], "--warmup-steps 2 leaves no step of the cosine decay (--steps 2)"),
    (["--clip-norm", "0"], "--clip-norm must be > 0 (a global gradient norm), got 0.0"),
    (["--weight-decay=-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--eval-every=-5"], "--eval-every must be >= 0 steps"),
    (["--eval-every", "5", "--model", "transformer", "--dataset", "tokens"], "--eval-every evaluates on the test split"),
])
def test_bad_input_fails_fast_with_a_message(capsys, compiles, extra, message):
  assert cli.main(BASE + extra) == 2
  err = capsys.readouterr().err
  assert message in err, err
  assert compiles == [], "the error must come before anything is compiled"


def test_an_unreachable_coordinator_fails_in_bounded_time_naming_the_address():
  with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:9 within 0\.5 s"):
    runtime.wait_for_coordinator("127.0.0.1:9", timeout_s=0.5)


@pytest.mark.parametrize("env, message", [
    ({"HETJAX_COORDINATOR": "127.0.0.1:1234"}, "HETJAX_NUM_HOSTS, HETJAX_HOST_ID is not"),
    ({"HETJAX_COORDINATOR": "x:1", "HETJAX_NUM_HOSTS": "2", "HETJAX_HOST_ID": "2"}, r"host_id must be in \[0, 2\)"),
])
def test_bad_cluster_environment_is_refused(env, message):
  with pytest.raises(ValueError, match=message):
    spec = runtime.spec_from_env(env)
    runtime._validate(spec)


def test_a_host_that_cannot_reach_the_coordinator_exits_naming_it():
  import os
  import subprocess
  import sys
  env = dict(os.environ, HETJAX_COORDINATOR="127.0.0.1:9", HETJAX_NUM_HOSTS="2", HETJAX_HOST_ID="1",
             HETJAX_INIT_TIMEOUT="1")
  run = subprocess.run([*module_command("hetjax.cli"), *BASE],
                       env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 2
  assert "Could not reach the hetjax coordinator at 127.0.0.1:9 within 1 s" in run.stderr


def test_a_two_host_run_shows_progress_on_host_0_only_and_its_report_matches(tmp_path):
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "run"
  run = subprocess.run(
      [sys.executable, os.path.join(root, "launch", "local.py"), "--hosts", "2", "--", sys.executable,
       "-m", "hetjax.cli", *BASE[:-1], str(out), "--steps", "12", "--log-every", "3",
       "--assignment", "48,16"], capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  progress = [line for line in run.stdout.splitlines() if "step " in line and "/12" in line]
  assert len(progress) == 4 and all(line.startswith("[host 0] ") for line in progress), run.stdout
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 13))  # Steps done, as the progress line.
  assert all(r["shares"] == [48, 16] and len(r["wait_s"]) == 2 for r in records)
  assert cli.main(["report", str(out)]) == 0
  assert (out / "report.png").stat().st_size > 10_000
  summary = json.loads((out / "summary.json").read_text())
  text = (out / "report.txt").read_text()
  assert f"{summary['samples_per_sec']:,.1f} samples/s measured" in text


def test_a_negative_looking_assignment_gets_the_equals_sign_fix(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(BASE + ["--assignment", "-8,56,48"])
  assert exit_.value.code == 2
  assert "e.g. --assignment=-8,56,48" in capsys.readouterr().err


def test_a_checkpoint_folder_that_is_a_file_is_called_a_file(tmp_path, capsys, compiles):
  blocker = tmp_path / "ckpt"
  blocker.write_text("x")
  assert cli.main(BASE + ["--ckpt-dir", str(blocker)]) == 2
  err = capsys.readouterr().err
  assert f"checkpoint folder {blocker} is a file, not a folder" in err and "permissions" not in err
  assert compiles == []


def test_the_optimizer_flags_build_a_schedule_counted_in_updates_with_clipping_and_decay():
  import jax.numpy as jnp
  import optax
  from hetjax import optimizers
  opt = optimizers.make("sgd", 0.1, schedule="linear", warmup_steps=2, total_steps=6,
                        clip_norm=1.0, weight_decay=0.5)
  params = {"w": jnp.array([[3.0, 4.0]])}  # A kernel: weight decay reaches it.
  state = opt.init(params)
  grads = {"w": jnp.array([[30.0, 40.0]])}  # Global norm 50: clipped to 1 -> (0.6, 0.8).
  rates = []
  for _ in range(6):
    updates, state = opt.update(grads, state, params)
    rates.append(float(state[1].hyperparams["learning_rate"]))
  assert rates == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025])
  # The last update: -lr * (clipped grad + decay * params) = -0.025 * ((0.6, 0.8) + 0.5 * (3, 4)).
  assert updates["w"][0].tolist() == pytest.approx([-0.025 * 2.1, -0.025 * 2.8])
  assert isinstance(optimizers.make("adam", 1e-3, weight_decay=0.01), optax.GradientTransformation)


# ---- weight decay: kernels, not biases or normalisation scales ----------------------


def _resnet_leaves(seed: int):
  """A real parameter tree (a small ResNet-18: convolutions, BatchNorm, a dense head), random
  values of its shapes, and the oracle's decay mask written by leaf name, not by shape."""
  import numpy as np
  from hetjax import models as zoo
  from hetjax.task import MASK
  task = zoo.build("resnet18", kind="image", num_classes=3, width=4, stage_sizes=(1,))
  batch = {"x": np.zeros((2, 8, 8, 1), np.float32), "y": np.zeros(2, np.int32),
           MASK: np.ones(2, np.float32)}
  shapes, _ = jax.eval_shape(task.init, jax.random.key(0), batch)
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
  by_name = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)
  return params, by_name


def _oracle(name: str, lr: float, decay: float, mask):
  """The command line's optimizer written with plain optax: optax.adamw is this chain."""
  import optax
  decayed = optax.add_decayed_weights(decay) if mask is None else optax.masked(
      optax.add_decayed_weights(decay), mask)
  if name == "adamw":
    return optax.chain(optax.scale_by_adam(), decayed, optax.scale(-lr))
  return optax.chain(decayed, optax.sgd(lr, momentum=0.9 if name == "momentum" else None))


@pytest.mark.parametrize("name", ["adamw", "sgd", "momentum"])
def test_weight_decay_reaches_kernels_and_spares_biases_and_norm_scales(name):
  import jax.numpy as jnp
  import numpy as np
  import optax
  from hetjax import optimizers
  params, by_name = _resnet_leaves(0)
  assert {"kernel", "scale", "bias"} <= {p[-1].key for p, _ in
                                         jax.tree_util.tree_leaves_with_path(params)}
  lr, decay = 0.1, 0.5
  for decay_all, mask in ((False, by_name), (True, None)):
    opt = optimizers.make(name, lr, weight_decay=decay, decay_all=decay_all)
    # Without a gradient, only the decay moves a weight.
    zeros = jax.tree.map(jnp.zeros_like, params)
    moved, _ = opt.update(zeros, opt.init(params), params)
    for (path, step), weight in zip(jax.tree_util.tree_leaves_with_path(moved),
                                    jax.tree.leaves(params)):
      decays = decay_all or path[-1].key == "kernel"
      np.testing.assert_allclose(step, -lr * decay * weight if decays else 0.0, rtol=1e-6,
                                 err_msg=f"{name} decay_all={decay_all}: {jax.tree_util.keystr(path)}")
    # Three updates with gradients against the plain optax oracle.
    oracle = _oracle(name, lr, decay, mask)
    rng = np.random.default_rng(1)
    got, want = params, params
    state, oracle_state = opt.init(params), oracle.init(params)
    for _ in range(3):
      grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
      updates, state = opt.update(grads, state, got)
      got = optax.apply_updates(got, updates)
      updates, oracle_state = oracle.update(grads, oracle_state, want)
      want = optax.apply_updates(want, updates)
    # inject_hyperparams holds adam's b1 and b2 as float32 arrays: ~1e-6 of rounding, where
    # a decay misplaced moves a weight by lr x decay = 5 % an update.
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name} decay_all={decay_all}: {jax.tree_util.keystr(path)}")


def test_decay_all_is_a_config_file_key_and_part_of_the_checkpoint_identity(tmp_path, capsys):
  from hetjax.cli import commands
  path = tmp_path / "run.yaml"
  path.write_text("optimizer: adamw\ndecay-all: true\n")
  everything = cli.parse_args(["train", "--config", str(path)])
  kernels = cli.parse_args(["train", "--optimizer", "adamw"])
  assert everything.decay_all and not kernels.decay_all
  # A checkpoint written before the mask (every leaf decayed) resumes only under decay-all.
  assert commands._optimizer_identity(everything) == "adamw|0.001|constant|0|None|None"
  assert commands._optimizer_identity(kernels) != commands._optimizer_identity(everything)
  # Decaying every leaf of an optimizer that decays none is refused before JAX starts.
  path.write_text("optimizer: adam\ndecay-all: true\n")
  assert cli.main(BASE + ["--config", str(path)]) == 2
  assert "`decay-all` chooses which leaves" in capsys.readouterr().err


def test_train_help_lists_at_most_40_flags_the_newcomers_first(capsys):
  with pytest.raises(SystemExit):
    cli.main(["train", "--help"])
  text = capsys.readouterr().out
  listed = re.findall(r"^  (?:-h, )?(--[a-z-]+)", text, re.M)
  assert len(listed) <= 40, listed
  first = text.split("start here:\n", 1)[1].split("\n\n", 1)[0]
  for flag in ("--config", "--model", "--dataset", "--global-batch", "--microbatch", "--steps",
               "--optimizer", "--lr", "--balancer", "--mode", "--out"):
    assert f"  {flag} " in first, flag
  for key in ("--reduction", "--update-layout", "--device-memory", "--device-batch-memory-fraction"):
    assert key not in text  # The platform decides; an expert overrides in a config file.


def test_a_config_key_typed_as_a_flag_names_the_config_file(capsys):
  with pytest.raises(SystemExit) as stop:
    cli.main(BASE + ["--reduction", "host"])
  assert stop.value.code == 2
  assert "reduction is a config-file key, not a flag" in capsys.readouterr().err


def test_every_field_is_a_config_key_and_reaches_its_config(tmp_path):
  from hetjax.cli import commands, flags
  from hetjax import config
  path = tmp_path / "run.yaml"
  path.write_text("reduction: host\nupdate-layout: whole\ndevice-memory: 4\nseed: 3\n"
                  "shard-within-host: on\ncheckpoints:\n  ckpt-dir: ck\n  ckpt-keep: 5\n"
                  "  async-save: false\n")
  args = cli.parse_args(BASE + ["--config", str(path), "--microbatch", "8"])
  train = commands._train_config(args)
  assert (train.reduction, train.update_layout, train.device_memory, train.seed,
          train.shard_within_host, train.microbatch) == ("host", "whole", 4.0, 3, "on", 8)
  ckpt = commands._checkpoint_config(args)
  assert (ckpt.directory, ckpt.keep, ckpt.async_save) == ("ck", 5, False)
  import dataclasses
  for cls in (config.TrainConfig, config.CheckpointConfig, config.RoundsConfig, flags.JobConfig):
    for field in dataclasses.fields(cls):
      assert flags.BY_NAME[field.name].help, field.name  # From the class's docstring.
  assert flags.as_flags("`ckpt_dir` and `update_layout`") == "--ckpt-dir and `update-layout`"


def test_the_token_flags_reach_the_data_loader():
  from hetjax.cli import commands
  args = cli.parse_args(["train", "--model", "transformer", "--dataset", "tokens",
                         "--seq-len", "12", "--vocab-size", "40"])
  source, _ = commands._load_data(args)
  assert source[np.arange(2)]["x"].shape == (2, 12) and source.info.vocab_size == 40


def test_auto_reduction_is_the_device_backend_unless_two_processes_share_a_gpu():
  from hetjax import mesh
  from hetjax.config import TrainConfig
  assert TrainConfig(global_batch=8).reduction == "auto"
  assert mesh.choose_reduction("auto") == "device"  # One process (and CPUs: gloo either way).
  assert mesh.choose_reduction("host") == "host"
  machine_a, machine_b = [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]
  gpu = lambda *ids: [float(sum(1 << i for i in ids if i // 16 == c) >> 16 * c) for c in range(4)]
  apart = np.array([machine_a + gpu(0), machine_a + gpu(1), machine_b + gpu(0)], np.float32)
  assert not mesh.shares_a_device(apart)  # GPU 0 of two machines: two devices.
  shared = np.array([machine_a + gpu(0, 1), machine_b + gpu(0), machine_a + gpu(1)], np.float32)
  assert mesh.shares_a_device(shared)


def test_docs_cli_names_every_flag_and_every_config_only_key():
  import pathlib
  from hetjax.cli import flags
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
  missing = [f.flag for f in flags.FIELDS if f.group and f"`{f.flag}" not in page]
  missing += [f.key for f in flags.FIELDS if not f.group and f"`{f.key}:" not in page
              and f"{f.key}: " not in page]
  assert not missing, f"docs/cli.md does not name {missing}"
