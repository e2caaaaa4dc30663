"""`hetjax train --wandb PROJECT`: an offline W&B run holds the config and every step's record.

WANDB_MODE=offline: nothing reaches the network; the run is read back from
the file wandb writes under OUT/wandb (a LevelDB-style log of protobuf
records, read here with wandb's own protobuf classes). Which run a resumed
job continues is checked with a stand-in for the library; that only host 0
opens one, across a real requeue, in tests/test_slurm_cluster.py.
"""

import glob
import json
import pathlib
import sys
import types

import pytest

from hetjax import cli
from hetjax.observe import tracking

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _wandb_records(path):
  """The protobuf records of a .wandb file (wandb's LevelDB-style log, 32 KiB blocks)."""
  from wandb.proto import wandb_internal_pb2 as pb
  data, pos, pending, block = pathlib.Path(path).read_bytes(), 7, b"", 32768  # 7: file header
  while pos + 7 <= len(data):
    left = block - pos % block
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    if left < 7 or kind == 0:  # A block's zero padding.
      pos += left
      continue
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST: a whole record.
      record = pb.Record()
      record.ParseFromString(pending)
      pending = b""
      yield record


def test_an_offline_run_holds_the_config_and_every_step(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  out = tmp_path / "run"
  assert cli.main(["train", "--model", "examples.custom_model:task", "--dataset",
                   "examples.custom_model:dataset", "--global-batch", "64", "--microbatch", "8",
                   "--steps", "4", "--log-every", "0", "--out", str(out), "--wandb", "hetjax-test"]) == 0
  (path,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
  assert path.endswith(f"run-{tracking.kept_run_id(str(out))}.wandb")  # The id a resume reuses.
  config, history = {}, []
  for record in _wandb_records(path):
    kind = record.WhichOneof("record_type")
    if kind in ("run", "config"):  # W&B may send the config with the run or after it.
      items = record.run.config.update if kind == "run" else record.config.update
      config.update({i.key: json.loads(i.value_json) for i in items})
    elif kind == "history":
      history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                      for i in record.history.item})
  assert config["model"] == "examples.custom_model:task" and config["steps"] == 4
  assert config["checkpoints"]["ckpt-every"] == 100  # The resolved config, sections and all.
  steps = [h for h in history if "loss" in h]
  assert [h["_step"] for h in steps] == [1, 2, 3, 4]  # Every record, at its step.
  jsonl = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert [h["loss"] for h in steps] == pytest.approx([r["loss"] for r in jsonl])
  assert all("host0/share" in h and "samples_per_sec" in h for h in steps)
  picture = [h for h in history if h.get("report/_type") == "image-file"]
  assert picture and picture[0]["report/path"].startswith("media/images/report")  # At the end.


def test_without_the_library_wandb_says_what_to_install(monkeypatch, capsys):
  monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None)
  assert cli.main(["train", "--model", "mlp", "--steps", "2", "--wandb", "p", "--out", "x"]) == 2
  assert "pip install 'hetjax[wandb]'" in capsys.readouterr().err


class _FakeWandb(types.ModuleType):
  """Stands in for the wandb library: records each init() and what the run was given."""

  def __init__(self):
    super().__init__("wandb")
    self.inits: list[dict] = []
    self.calls: list[tuple] = []  # ("finish" | "teardown", exit code), in order.
    self.Settings = lambda **kwargs: kwargs
    self.Image = lambda path: path

  def init(self, **kwargs):
    self.inits.append(kwargs)
    return types.SimpleNamespace(
        log=lambda values, step=None: None, summary={},
        finish=lambda exit_code=None: self.calls.append(("finish", exit_code)))

  def teardown(self, exit_code=None):
    self.calls.append(("teardown", exit_code))


def _record(step: int) -> dict:
  return {"step": step, "loss": 1.0, "samples_per_sec": 10.0, "step_s": 0.1, "metrics": {},
          "shares": [8, 8], "compute_s": [0.1, 0.1], "wait_s": [0.0, 0.0]}


def test_a_resumed_job_continues_its_run_and_a_fresh_one_opens_a_new(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  out = str(tmp_path / "run")

  def attempt(first_step: int | None) -> dict | None:
    run = tracking.WandbRun("p", {}, out)
    if first_step is not None:
      run(_record(first_step))
    run.finish()
    return fake.inits[-1] if fake.inits else None

  first = attempt(1)  # A fresh job: a new run, its id kept under OUT.
  assert first["resume"] == "allow" and tracking.kept_run_id(out) == first["id"]
  assert attempt(41)["id"] == first["id"]  # Resumed at step 40: the same run.
  assert attempt(None)["id"] == first["id"]  # Resumed at its end: no step, the same run.
  fresh = attempt(1)  # Started afresh in the same OUT: a new run, as metrics.jsonl.
  assert fresh["id"] != first["id"] and tracking.kept_run_id(out) == fresh["id"]
  assert len(fake.inits) == 4


def test_a_run_that_never_logged_closes_without_opening(tmp_path, monkeypatch):
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  tracking.WandbRun("p", {}, str(tmp_path)).close(exit_code=1)  # The CLI's failure path.
  assert fake.inits == [] and tracking.kept_run_id(str(tmp_path)) is None


@pytest.mark.parametrize("failed", [False, True])
def test_a_run_is_written_out_before_the_job_leaves(tmp_path, monkeypatch, failed):
  """`run.finish` only informs wandb's service; a job that leaves by os._exit (a stop, a lost
  host) skips wandb's atexit hook, so the run must wait for the service (`teardown`)."""
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  run = tracking.WandbRun("p", {}, str(tmp_path))
  run(_record(1))
  if failed:
    run.close(exit_code=1)
  else:
    run.finish({"loss": 1.0})
  code = 1 if failed else 0
  assert fake.calls == [("finish", code), ("teardown", code)]
