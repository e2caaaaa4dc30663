"""`hetjax train`: every bad input is refused with a clear error before anything compiles."""

import jax
import pytest

from hetjax import cli
from hetjax.cluster import runtime

BASE = ["train", "--model", "mlp", "--dataset", "digits", "--steps", "2", "--out", "unused"]


@pytest.fixture
def compiles():
  events = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: events.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  return events


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
    (["--global-batch", "5000"], "fewer than one global batch (5000)"),
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
  env = dict(os.environ, HETJAX_COORDINATOR="127.0.0.1:9", HETJAX_NUM_HOSTS="2", HETJAX_HOST_ID="1")
  run = subprocess.run([sys.executable, "-m", "hetjax.cli", *BASE, "--init-timeout", "1"],
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
  params = {"w": jnp.array([3.0, 4.0])}
  state = opt.init(params)
  grads = {"w": jnp.array([30.0, 40.0])}  # Global norm 50: clipped to 1 -> (0.6, 0.8).
  rates = []
  for _ in range(6):
    updates, state = opt.update(grads, state, params)
    rates.append(float(state[1].hyperparams["learning_rate"]))
  assert rates == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025])
  # The last update: -lr * (clipped grad + decay * params) = -0.025 * ((0.6, 0.8) + 0.5 * (3, 4)).
  assert updates["w"].tolist() == pytest.approx([-0.025 * 2.1, -0.025 * 2.8])
  assert isinstance(optimizers.make("adam", 1e-3, weight_decay=0.01), optax.GradientTransformation)
