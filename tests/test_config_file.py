"""`hetjax train --config FILE`: a file of flags, overridden by the command line, checked like flags."""

import pathlib

import pytest
import yaml

from hetjax import cli
from hetjax.cli import config_file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _resolved(argv):
  return cli.resolved_config(cli.parse_args(argv))


def test_a_file_plus_two_flags_resolves_like_the_equivalent_flags(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("model: mlp\nglobal-batch: 96\nassignment: [32, 64]\nlr: 3e-3\n"
                  "modes:\n  mode: sync\ncheckpoints:\n  ckpt-dir: ck\n  ckpt-every: 5\n"
                  "  resume: false\n")
  from_file = _resolved(["train", "--config", str(path), "--lr", "0.01", "--ckpt-every", "7"])
  no_resume = tmp_path / "no-resume.yaml"  # `resume` is a config key without a flag.
  no_resume.write_text("checkpoints:\n  no-resume: true\n")  # The former flag's name reads too.
  from_flags = _resolved(["train", "--model", "mlp", "--global-batch", "96", "--assignment",
                          "32,64", "--lr", "0.01", "--ckpt-dir", "ck", "--ckpt-every", "7",
                          "--config", str(no_resume)])
  assert from_file == from_flags
  assert from_file["lr"] == 0.01 and from_file["checkpoints"]["ckpt-every"] == 7
  assert from_file["checkpoints"]["resume"] is False
  # What a run writes reads back to itself.
  again = tmp_path / "config.yaml"
  again.write_text(config_file.dump(from_file, head=True))
  assert _resolved(["train", "--config", str(again)]) == from_file


def test_print_config_prints_the_resolved_yaml_and_exits(tmp_path, capsys):
  path = tmp_path / "run.yaml"
  path.write_text("model: mlp\nsteps: 3\n")
  assert cli.main(["train", "--config", str(path), "--steps", "4", "--print-config",
                   "--out", str(tmp_path / "never")]) == 0
  printed = yaml.safe_load(capsys.readouterr().out)
  assert printed["model"] == "mlp" and printed["steps"] == 4
  assert not (tmp_path / "never").exists(), "--print-config must not start a run"


@pytest.mark.parametrize("text, message", [
    ("global-bach: 64\n", "unknown key 'global-bach' (did you mean 'global-batch'?)"),
    ("global-batch: many\n", "global-batch must be an int, got 'many'"),
    ("reduction: mpi\n", "reduction 'mpi' is not one of auto, device, host"),
    ("checkpoints:\n  resume: maybe\n", "resume must be true or false"),
    ("global-batch: 0\n", "--global-batch must be >= 1, got 0"),
    ("- a list\n", "must hold a mapping of flag names to values"),
    ("model: [unclosed\n", "is not valid YAML"),
    # Every key has one place; a key elsewhere, or twice, names both places.
    ("model: mlp\nmodes:\n  global-batch: 48\n",
     "line 3: `global-batch` belongs at the top level, found in section `modes`"),
    ("ckpt-dir: ck\n", "line 1: `ckpt-dir` belongs in section `checkpoints`, found at the top level"),
    ("modes:\n  ckpt-every: 5\n", "`ckpt-every` belongs in section `checkpoints`, found in section `modes`"),
    ("lr: 0.1\nmodel: mlp\nlr: 0.2\n", "`lr` given twice: line 1 and line 3; keep one"),
    ("modes:\n  mode: sync\n  mode: hybrid\n", "`mode` given twice: line 2 (section `modes`) and line 3"),
])
def test_a_bad_file_fails_before_jax_like_a_bad_flag(tmp_path, capsys, text, message):
  path = tmp_path / "bad.yaml"
  path.write_text(text)
  with pytest.raises(SystemExit) as stop:
    cli.main(["train", "--config", str(path), "--print-config"])
  assert stop.value.code == 2  # A usage error, as for a flag.
  assert message in capsys.readouterr().err


def test_a_missing_file_is_named(capsys):
  with pytest.raises(SystemExit):
    cli.main(["train", "--config", "/nonexistent-hetjax/run.yaml"])
  assert "cannot read config file /nonexistent-hetjax/run.yaml" in capsys.readouterr().err


def test_the_example_config_is_the_readme_demo():
  example = _resolved(["train", "--config", str(ROOT / "examples" / "demo.yaml")])
  flags = _resolved(["train", "--model", "cnn", "--dataset", "digits", "--global-batch", "96",
                     "--microbatch", "4", "--steps", "300", "--balancer", "dynamic",
                     "--eval-every", "50", "--out", "runs/demo", "--ckpt-dir", "runs/demo/ckpt",
                     "--ckpt-every", "100"])
  assert example == flags
