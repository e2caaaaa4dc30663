"""Quiet recovery, clear failure: what `hetjax train` says and does around a bad checkpoint.

- A damaged newest checkpoint (an array file, or its metadata) is skipped with
  one line on stderr, moved aside as STEP.damaged, and the run resumes from
  the previous one, saves that step again and finishes.
- A checkpoint that cannot be written (a stand-in raising the write error
  tensorstore gives on a full disk) stops the run with one message and exit
  code 74; the earlier checkpoint is intact and the next run resumes from it.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from hetjax import cli
from hetjax.checkpoint import manager, quiet

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["train", "--model", "examples.custom_model:task", "--dataset",
         "examples.custom_model:dataset", "--global-batch", "64", "--microbatch", "8",
         "--ckpt-every", "2", "--log-every", "0"]
# Run in the child: every save of step 4 fails inside orbax as a full disk does.
FAIL_AT_4 = """
import sys
import orbax.checkpoint as ocp
from hetjax import cli
save = ocp.CheckpointManager.save
def failing(self, step, *a, **k):
  if step == 4:
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file "
                     "\\"ck/4.orbax-checkpoint-tmp/state/d/x\\": [OS error: No space left on device]")
  return save(self, step, *a, **k)
ocp.CheckpointManager.save = failing
sys.exit(cli.main(sys.argv[1:]))
"""


def _run(args, stand_in=None):
  code = stand_in or "import sys; from hetjax import cli; sys.exit(cli.main(sys.argv[1:]))"
  return subprocess.run([sys.executable, "-c", code, *FLAGS, *args], cwd=ROOT, timeout=300,
                        capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _in_process(args):
  """`hetjax train` in this process (a run that ends well returns; JAX is warm already)."""
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    return cli.main([*FLAGS, *args])
  finally:
    os.chdir(cwd)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
  """A checkpoint folder holding steps 2 and 4."""
  folder = tmp_path_factory.mktemp("ck")
  assert _in_process(["--steps", "4", "--ckpt-dir", str(folder / "ck"),
                      "--out", str(folder / "run")]) == 0
  assert sorted(os.listdir(folder / "ck")) == ["2", "4"]
  return folder / "ck"


def _damage_arrays(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  biggest = max(files, key=lambda p: p.stat().st_size)  # The array data, not an index node.
  with open(biggest, "r+b") as f:
    f.truncate(biggest.stat().st_size // 2)


def _damage_meta(step_dir):
  (step_dir / "meta" / "metadata").write_text("{not json")


@pytest.mark.parametrize("damage", [_damage_arrays, _damage_meta])
def test_a_damaged_newest_checkpoint_is_one_line_moved_aside_and_saved_again(
    tmp_path, four_steps, damage, capfd):
  ck = tmp_path / "ck"
  shutil.copytree(four_steps, ck)
  damage(ck / "4")
  capfd.readouterr()
  assert _in_process(["--steps", "6", "--ckpt-dir", str(ck), "--out", str(tmp_path / "run")]) == 0
  out, err = capfd.readouterr()  # File descriptors: what orbax's threads print counts too.
  about = [l for l in err.splitlines() if "checkpoint" in l]
  assert len(about) == 1 and f"{ck}/4" in about[0] and "4.damaged" in about[0], err
  assert "Traceback" not in err and "Event loop is closed" not in err, err
  assert f"resumed from {ck}/2" in out
  assert sorted(os.listdir(ck)) == ["2", "4", "4.damaged", "6"]  # Step 4 saved again.


def test_a_checkpoint_that_cannot_be_written_stops_with_one_message_and_the_last_resumes(
    tmp_path, capsys):
  ck = tmp_path / "ck"
  failed = _run(["--steps", "6", "--ckpt-dir", str(ck), "--out", str(tmp_path / "run")],
                stand_in=FAIL_AT_4)
  assert failed.returncode == manager.WRITE_FAILED_EXIT == 74, failed.stderr[-3000:]
  lines = [l for l in failed.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, failed.stderr  # One message, no tracebacks.
  message = lines[0]
  for part in (f"cannot write checkpoint {ck}/4", "No space left on device", "Free space there: ",
               "; a checkpoint takes about ", f"The last good checkpoint, {ck}/2, is intact",
               "resume with: ", "--ckpt-dir", "(exit code 74)"):
    assert part in message, message
  assert "2" in os.listdir(ck)
  assert _in_process(["--steps", "6", "--ckpt-dir", str(ck), "--out", str(tmp_path / "run")]) == 0
  assert f"resumed from {ck}/2" in capsys.readouterr().out
  assert {"2", "4", "6"} <= set(os.listdir(ck))


def test_only_callbacks_on_a_closed_event_loop_are_kept_off_stderr():
  import asyncio
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(lambda: None)
  except RuntimeError as e:
    error, tb = e, e.__traceback__
  # What tensorstore's completion callback raises: no Python caller above asyncio.
  assert quiet._from_a_closed_loop(RuntimeError, error, tb.tb_next)
  # The same error from user code (a frame of ours first) is left to the usual hook.
  assert not quiet._from_a_closed_loop(RuntimeError, error, tb)
  assert not quiet._from_a_closed_loop(ValueError, ValueError("x"), tb.tb_next)
