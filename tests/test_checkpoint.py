"""Checkpoints on one host: exact resume, damaged folders, another job, bad folders, SIGTERM."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath

import hetjax
from hetjax import models as zoo
from hetjax import cli, trainer
from hetjax.checkpoint import manager as checkpoint
from hetjax.input import data
from hetjax.cluster import procs
from hetjax.checkpoint import snapshot
from hetjax.testing import run_hosts

from _warm_client import module_command

DIGITS = data.load("digits")


def _trainer(directory, *, resume=True, every=3, width=None, optimizer=None, keep=3,
             precision="fp32"):
  hetjax.initialize()
  overrides = {} if width is None else {"hidden": (width, width)}
  task = zoo.build("mlp", kind="image", num_classes=10, **overrides)
  return trainer.Trainer(
      task, optimizer or optax.adam(1e-3), DIGITS,
      trainer.TrainConfig(global_batch=64, microbatch=4, precision=precision),
      checkpoint=checkpoint.CheckpointConfig(str(directory), every=every, keep=keep, resume=resume))


def _digest(tr, until):
  tr.fit(until=until)
  return trainer.params_digest(tr.params())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The digest of a 10-step run that was never stopped."""
  return _digest(_trainer(tmp_path_factory.mktemp("ref"), resume=False), until=10)


@pytest.mark.parametrize("stop_at", [4, 7])
def test_stopping_and_resuming_gives_the_uninterrupted_parameters_bit_for_bit(
    tmp_path, uninterrupted, stop_at):
  _trainer(tmp_path).fit(until=stop_at)
  resumed = _trainer(tmp_path)
  assert resumed.resumed_from == stop_at and resumed.step == stop_at
  assert _digest(resumed, until=10) == uninterrupted


def test_a_background_save_is_not_disturbed_by_the_steps_that_follow(tmp_path, uninterrupted,
                                                                     monkeypatch):
  # The save of step 6 is held in flight (its background commit waits for a
  # handshake) while steps 7 and 8 run and donate their input buffers; only
  # then is it let finish. Resuming from 6 must still continue exactly.
  from orbax.checkpoint._src.checkpointers import async_checkpointer
  release, real = threading.Event(), async_checkpointer._background_wait_for_commit_futures

  held_saves = []

  def held(directory, *args, **kwargs):
    if str(directory.name).split(".")[0] == "6":
      held_saves.append(6)
      assert release.wait(timeout=300), "step 8 never ran"
    return real(directory, *args, **kwargs)

  monkeypatch.setattr(async_checkpointer, "_background_wait_for_commit_futures", held)
  in_flight = []

  def after(tr, metrics):
    if tr.step == 8:
      in_flight.append(not (tmp_path / "6" / "commit_success.txt").exists())
      release.set()

  _trainer(tmp_path).fit(until=8, on_step=after)
  assert held_saves == [6] and in_flight == [True], "the save of step 6 was not in flight"
  shutil.rmtree(tmp_path / "8")
  assert _digest(_trainer(tmp_path), until=10) == uninterrupted


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copy"])
def test_a_background_save_hands_a_snapshot_to_a_worker_and_the_next_steps_may_donate_the_state(
    tmp_path, uninterrupted, monkeypatch, copy):
  # The worker's hand-over of step 6 is held until steps 7 and 8 have run
  # and donated what they could of the arrays the save of step 6 was called
  # with: orbax must be reading the snapshot. With views (CPU) JAX may not
  # donate the viewed buffers; with a copy (the GPU path) it does.
  monkeypatch.setattr(checkpoint.snapshot_lib, "SnapshotTaker",
                      functools.partial(snapshot.SnapshotTaker, copy=copy))
  release, real = threading.Event(), checkpoint.Checkpointer._hand_over
  workers = []

  def held(self, step, state, meta):
    if step == 6:
      workers.append(threading.current_thread() is not threading.main_thread())
      assert release.wait(timeout=300), "step 8 never ran"
    return real(self, step, state, meta)

  monkeypatch.setattr(checkpoint.Checkpointer, "_hand_over", held)
  # The arrays each save is called with (read from the trainer, `Trainer.state`
  # would be lent to the caller and never donated).
  saved, donated, real_save = {}, [], checkpoint.Checkpointer.save_in_background

  def recording(self, step, state, *args):
    saved[step] = state
    return real_save(self, step, state, *args)

  monkeypatch.setattr(checkpoint.Checkpointer, "save_in_background", recording)

  def after(tr, metrics):
    if tr.step == 8:
      donated.append(all(x.is_deleted() for x in jax.tree.leaves(saved[6].params)))
      release.set()

  tr = _trainer(tmp_path)
  tr.fit(until=8, on_step=after)
  assert workers == [True] and donated == [copy]
  assert tr.checkpointer.snapshot_s and tr.checkpointer.handover_s
  shutil.rmtree(tmp_path / "8")
  resumed = _trainer(tmp_path)
  assert resumed.resumed_from == 6
  assert _digest(resumed, until=10) == uninterrupted


def test_on_two_hosts_a_held_hand_over_lets_the_training_collectives_run_and_resumes_exactly(
    tmp_path):
  # Host 1's worker holds the save of step 3 while both hosts train steps 4
  # and 5; host 0's worker meanwhile waits at orbax's first barrier. Were that
  # barrier a device collective (orbax's default), it would meet host 1's
  # training programs (tried: gloo aborts, "collective mismatch"). Two
  # devices per host: the snapshot holds one replica of each.
  results = run_hosts("_ckpt_entries:hand_over_held_on_one_host", hosts=2, devices_per_host=2,
                      args=(str(tmp_path), 1, 7), timeout_s=600)
  assert [r["held"] for r in results] == [[], [True]]
  for r in results:
    assert r["resumed_from"] == 3
    assert r["digest"] == r["reference"]


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, uninterrupted, capsys):
  _trainer(tmp_path).fit(until=7)  # Checkpoints 3, 6 and 7.
  for root, _, files in os.walk(tmp_path / "7" / "state"):
    for name in files:
      if name not in ("commit_success.txt",):
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(max(0, os.path.getsize(f.name) // 2))
  resumed = _trainer(tmp_path)
  err = capsys.readouterr().err
  assert f"checkpoint {tmp_path}/7 has damaged or incomplete arrays: skipped (moved to 7.damaged" in err
  assert resumed.resumed_from == 6
  assert _digest(resumed, until=10) == uninterrupted


def _write_pre_mixed_precision_checkpoint(directory, tr):
  """The checkpoint hetjax wrote before mixed precision: a TrainState with no loss_scale."""
  old_state = {k: v for k, v in tr.state._asdict().items() if k != "loss_scale"}
  meta = {"format": checkpoint.FORMAT, "step": tr.step, **tr.checkpoint_meta()}
  manager = ocp.CheckpointManager(epath.Path(directory),
                                  options=ocp.CheckpointManagerOptions(create=True))
  manager.save(tr.step, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(old_state), meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


@pytest.fixture(scope="module")
def pre_mixed_precision_folder(tmp_path_factory):
  """A folder whose only checkpoint (step 6) has the old format."""
  writer = _trainer(tmp_path_factory.mktemp("writer"), every=100)
  writer.fit(until=6)
  folder = tmp_path_factory.mktemp("old-format")
  _write_pre_mixed_precision_checkpoint(folder, writer)
  with open(folder / "6" / "state" / "_METADATA") as f:
    assert "loss_scale" not in f.read()  # Really the old format.
  return folder


def test_a_checkpoint_from_before_mixed_precision_resumes_exactly(
    tmp_path, pre_mixed_precision_folder, uninterrupted, capsys):
  shutil.copytree(pre_mixed_precision_folder, tmp_path, dirs_exist_ok=True)
  resumed = _trainer(tmp_path)
  captured = capsys.readouterr()
  out = captured.out
  assert resumed.resumed_from == 6, out
  assert "skipped" not in captured.err
  assert out.count("predates loss_scale; loss scale set to 1, the default") == 1, out
  assert _digest(resumed, until=10) == uninterrupted


def test_an_fp16_run_resuming_a_checkpoint_without_loss_scale_starts_its_default_scale(
    tmp_path, pre_mixed_precision_folder, capsys):
  shutil.copytree(pre_mixed_precision_folder, tmp_path, dirs_exist_ok=True)
  resumed = _trainer(tmp_path, precision="fp16")
  assert resumed.resumed_from == 6
  assert "loss scale set to 32768, the default" in capsys.readouterr().out
  assert float(resumed.state.loss_scale.scale) == 2.0 ** 15
  assert int(resumed.state.loss_scale.good_steps) == 0
  resumed.fit(until=8)  # And the restored state trains on, saving the new format.
  assert resumed.step == 8 and (tmp_path / "8" / "commit_success.txt").exists()


def test_a_checkpoint_without_its_commit_marker_is_never_loaded(tmp_path, capsys):
  _trainer(tmp_path).fit(until=7)
  os.remove(tmp_path / "7" / "commit_success.txt")
  resumed = _trainer(tmp_path)
  assert "was never completed" in capsys.readouterr().err
  assert resumed.resumed_from == 6
  assert (tmp_path / "7.damaged").is_dir()  # Kept for inspection; step 7 can be saved again.


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_saying_what_differs(tmp_path):
  _trainer(tmp_path).fit(until=3)
  with pytest.raises(ValueError, match=r"another job: params differ .*saved \(64, 128\) float32, now \(64, 32\)"):
    _trainer(tmp_path, width=32)
  with pytest.raises(ValueError, match="optimizer state has another structure"):
    _trainer(tmp_path, optimizer=optax.sgd(0.1))
  assert _trainer(tmp_path, resume=False).resumed_from is None  # --no-resume starts afresh.


@pytest.mark.parametrize("bad", ["file", "under-file"])
def test_an_unwritable_checkpoint_folder_fails_before_anything_compiles(tmp_path, bad, capsys):
  blocker = tmp_path / "not-a-folder"
  blocker.write_text("x")
  target = blocker if bad == "file" else blocker / "ckpt"
  with pytest.raises(ValueError, match="is a file|lies under"):
    checkpoint.CheckpointConfig(str(target)).validate()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  assert cli.main(["train", "--model", "mlp", "--ckpt-dir", str(target)]) == 2
  assert "not a folder" in capsys.readouterr().err
  assert compiles == [], "the error must come before anything is compiled"
  jax.jit(lambda x: x + 1)(np.float32(1))  # The listener does hear a compilation.
  assert compiles


def test_bad_checkpoint_settings_are_refused(tmp_path):
  # The Python API names its fields; the command line words them as flags (tests/test_cli.py).
  with pytest.raises(ValueError, match="`every` must be >= 1"):
    checkpoint.CheckpointConfig(str(tmp_path), every=0).validate()
  with pytest.raises(ValueError, match="`keep` must be >= 1"):
    checkpoint.CheckpointConfig(str(tmp_path), keep=0).validate()


def test_only_the_newest_k_checkpoints_are_kept(tmp_path):
  _trainer(tmp_path, every=2, keep=2).fit(until=9)
  assert sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == [8, 9]


def _cli(out, ckpt, steps):
  # Every 100 of 1000 steps: the signal comes after the first checkpoint, and
  # its save is at whatever boundary the stop lands on, not a multiple of 100.
  ckpt_flags = [] if ckpt is None else ["--ckpt-dir", str(ckpt), "--ckpt-every", "100"]
  return [*module_command("hetjax.cli"), "train", "--model", "mlp", "--global-batch", "32",
          "--microbatch", "4", "--steps", str(steps), *ckpt_flags, "--out", str(out),
          "--log-every", "0"]


def test_sigterm_saves_at_the_next_step_boundary_exits_75_and_the_rerun_resumes(tmp_path):
  steps = 1000
  # The uninterrupted reference: no checkpoints (saving must not change the
  # parameters, so this is the stricter reference), and in its own process
  # beside the stopped run and its rerun (they share nothing but the machine).
  ref_log = open(tmp_path / "ref.log", "w+")  # A file: a pipe nobody reads could fill.
  ref = subprocess.Popen(_cli(tmp_path / "ref", None, steps), stdout=ref_log, stderr=ref_log)
  try:
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(_cli(tmp_path / "run", ckpt, steps), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any(p.isdigit() for p in (os.listdir(ckpt) if ckpt.exists() else [])):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == procs.PREEMPTED_EXIT, err[-2000:]
    preempted_at = int(err.split("checkpoint of step ")[1].split()[0])
    assert 0 < preempted_at < steps and str(preempted_at) in os.listdir(ckpt)
    again = subprocess.run(_cli(tmp_path / "run", ckpt, steps), capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from {ckpt}/{preempted_at}" in again.stdout
    assert ref.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-2000:]
  finally:
    if ref.poll() is None:
      ref.kill()
      ref.wait()
    ref_log.close()
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  reference = json.loads((tmp_path / "ref" / "summary.json").read_text())
  assert summary["resumed_from"] == preempted_at
  assert summary["params_digest"] == reference["params_digest"]


def test_a_finished_run_started_again_resumes_does_nothing_and_keeps_its_checkpoint(
    tmp_path, uninterrupted):
  _trainer(tmp_path).fit(until=10)
  again = _trainer(tmp_path)
  summary = again.fit(until=10, eval_source=data.load("digits", "test"))
  assert again.resumed_from == 10 and summary["steps"] == 0 and summary["last_step"] == 10
  assert summary["eval"]["step"] == 10 and 0 <= summary["eval"]["accuracy"] <= 1  # Still evaluated.
  assert trainer.params_digest(again.params()) == uninterrupted


def test_a_url_reaches_orbax_unchanged_and_skips_the_local_checks(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  checkpoint.CheckpointConfig("gs://some-bucket/run").validate()  # No local probe...
  assert os.listdir(tmp_path) == []  # ...and no local folder named "gs:".
  seen = []
  monkeypatch.setattr(checkpoint.ocp, "CheckpointManager",
                      lambda directory, **options: seen.append(directory))
  ckpt = checkpoint.Checkpointer(checkpoint.CheckpointConfig("gs://some-bucket/run"), bool)
  assert ckpt.directory == "gs://some-bucket/run"
  assert [str(d) for d in seen] == ["gs://some-bucket/run"] and os.listdir(tmp_path) == []
  assert checkpoint.resolve("rel/ckpt") == str(tmp_path / "rel" / "ckpt")
