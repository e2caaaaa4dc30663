"""Output that reads well: one step numbering, one progress line, named units, clear adapter errors."""

import io

import pytest

import _metrics_fixture as fixture
import hetjax
from hetjax.cli import commands as cli
from hetjax.cluster import hostgroup
from hetjax.observe import progress


def test_the_api_log_line_is_the_cli_progress_line():
  records = fixture.records(steps=20)
  seen, out = [], io.StringIO()
  sink = progress.log_sink(20, host_id=0, every=10, log=seen.append)
  bar = progress.Progress(20, host_id=0, stream=out, every=10, tty=False)
  for r in records:
    sink(r)
    bar.update(r)
  assert seen == out.getvalue().splitlines()
  assert [line.split()[1] for line in seen] == ["10/20", "20/20"]  # Steps done, as records count.
  assert "ETA" in seen[-1] and "samples/s" in seen[-1]


def test_a_loss_of_the_other_adapter_is_refused_naming_both_forms():
  from flax import nnx

  class Tiny(nnx.Module):
    def __init__(self):
      self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
      return self.dense(x)

  with pytest.raises(ValueError, match=r"from_nnx calls per_example_loss\(outputs, batch\), but "
                     r"the loss given takes \(params, batch, rng\); it looks written for "
                     r"from_functions"):
    hetjax.from_nnx(Tiny(), lambda params, batch, rng: (params, {}))
  with pytest.raises(ValueError, match=r"from_functions calls per_example_loss\(params, batch, "
                     r"rng\).*written for from_linen or from_nnx"):
    hetjax.from_functions(lambda rng, batch: {}, lambda outputs, batch: (outputs, {}))


def test_gloo_connection_lines_are_hidden_by_the_launcher_unless_asked_for(monkeypatch):
  line = "[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 2"
  assert hostgroup._GLOO_CONNECTED.match(line)
  assert not hostgroup._GLOO_CONNECTED.match("[hetjax] host 1 of 3 joining coordinator")


def test_a_rounds_summary_says_which_figures_are_per_round(capsys):
  host = {"batch": [96, 128], "tau": [3, 4], "compute_s": [0.1] * 3, "wait_s": [0.05] * 3}
  cli._print_summary({"mode": "hybrid", "steps": 4, "global_batch": 64, "hosts": 1,
                      "emulated_speeds": False, "per_host": [host]})
  out = capsys.readouterr().out
  assert "hybrid mode, 4 rounds" in out and "64 samples/local step over 1 host" in out
  assert "128 samples/round (4 local steps)" in out and "ms/round" in out
  cli._print_summary({"steps": 4, "global_batch": 64, "hosts": 1, "emulated_speeds": False,
                      "per_host": [host]})
  assert "128 samples/step" in capsys.readouterr().out


def test_the_end_of_a_run_reads_as_rounded_figures_with_units_and_points_at_the_json(capsys):
  host = {"batch": [24, 8], "compute_s": [0.05] * 4, "wait_s": [0.01] * 4}
  goodput = {"fraction": 0.6123, "wall_s": 125.0, "compute_s": 76.5, "attempts": 2,
             "redone_steps": 7, "emulated": False,
             "badput_s": {"startup": 10.0, "compiling": 20.0, "restart wait": 18.5},
             "per_host": [{"goodput": 0.6123, "flops_per_s": 2.5e12, "peak_fraction": 0.008,
                           "peak_flops_per_s": 312e12, "peak_device": "A100",
                           "peak_source": "vendor figure: NVIDIA A100 datasheet",
                           "emulated": False}]}
  cli._print_summary({"steps": 30, "global_batch": 32, "hosts": 1, "emulated_speeds": False,
                      "samples_per_sec": 1312.463390088058, "final_loss": 0.123456,
                      "test_accuracy": 0.98765, "params_digest": "ab" * 32, "goodput": goodput,
                      "per_host": [host]}, "runs/x")
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == ("hetjax: 30 steps, 2.1 min job time, 1,312.5 samples/s, 32 samples/step "
                      "over 1 host, final loss 0.1235, test accuracy 98.77%")
  text = "\n".join(lines)
  assert "goodput: 61.2% of 2.1 min job time trained the model (1 restart, 7 steps redone)" in text
  assert "badput: compiling 16.0%, restart wait 14.8%, startup 8.0%" in text
  assert "2.50 TFLOP/s achieved, 0.8% of A100 peak 312.00 TFLOP/s (vendor figure" in text
  assert lines[-1].startswith("  every figure: runs/x/summary.json") and "{" not in text
