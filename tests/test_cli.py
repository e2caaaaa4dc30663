"""`hetjax train`: every bad input is refused with a clear error before anything compiles."""

import jax
import pytest

from hetjax import cli, runtime

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
