"""`hetjax train --wandb PROJECT`: the run in Weights & Biases, from host 0.

Host 0 alone (the others' records are the same) logs the resolved config, every
metrics record as its TensorBoard scalars, the summary's figures (goodput,
badput_s/<cause>, host<i>/flops_per_s, balancer_saving/*) and the report picture.

A resumed job continues the same W&B run: its id is kept in OUT/wandb_run_id
and passed back with `resume="allow"`; whether it resumed is read from its first
record (a step after 1). Steps redone after a crash are dropped by W&B, which
keeps a run's steps increasing.

`wandb` is an optional extra (`check_installed` says so before JAX starts); the
mode, API key and entity come from wandb's own environment variables. Console
capture is off: the progress line and the launchers' host prefixes own stdout.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from typing import Any

from hetjax.observe import goodput_summary
from hetjax.observe import metrics as metrics_lib

EXTRA = "pip install 'hetjax[wandb]'  (or: pip install wandb)"
RUN_ID_FILE = "wandb_run_id"  # Under OUT: the W&B run a resumed job continues.


def check_installed() -> None:
  """Raises ValueError naming what to install when the `wandb` library is missing."""
  if importlib.util.find_spec("wandb") is None:
    raise ValueError(f"--wandb logs to Weights & Biases, which needs the wandb library; "
                     f"install it with {EXTRA}, or drop --wandb.")


def kept_run_id(out_dir: str) -> str | None:
  """The W&B run id an earlier attempt of this job kept in OUT, or None."""
  try:
    with open(os.path.join(out_dir, RUN_ID_FILE)) as f:
      return f.read().strip() or None
  except FileNotFoundError:
    return None


def _keep_run_id(out_dir: str, run_id: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, RUN_ID_FILE)
  with open(path + ".tmp", "w") as f:
    f.write(run_id + "\n")
  os.replace(path + ".tmp", path)  # Never half written, whenever the job is stopped.


class _NotOpened:
  """`WandbRun.run` before the first record: finishing it does nothing."""

  def finish(self, **kwargs: Any) -> None:
    del kwargs


class WandbRun:
  """One W&B run fed like a metrics sink: `run(record)` per step, `finish()` at the end.

  Args:
    project: the W&B project.
    config: the resolved configuration (nested dicts, as OUT/config.yaml).
    out_dir: the run folder (wandb's files under OUT/wandb, the id in OUT/wandb_run_id).
    name: the run's display name (default: W&B's own).
  """

  def __init__(self, project: str, config: dict[str, Any], out_dir: str, name: str | None = None):
    import wandb  # Only host 0 of a --wandb run pays for the import.

    self._wandb = wandb
    self._init = dict(project=project, config=config, dir=out_dir, name=name)
    self._out_dir = out_dir
    self._run = None

  @property
  def run(self):
    """The wandb run (a stand-in whose `finish` does nothing before the first record)."""
    return _NotOpened() if self._run is None else self._run

  def _open(self, resumed: bool) -> None:
    run_id = kept_run_id(self._out_dir) if resumed else None
    if run_id is None:
      run_id = secrets.token_hex(4)
      _keep_run_id(self._out_dir, run_id)
    self._run = self._wandb.init(id=run_id, resume="allow", **self._init,
                                 settings=self._wandb.Settings(console="off"))

  def __call__(self, record: dict[str, Any]) -> None:
    """Logs one metrics record (`hetjax.observe.metrics` schema) at its step."""
    step = int(record["step"])
    if self._run is None:
      self._open(resumed=step > 1)
    self._run.log(metrics_lib.scalars_of(record), step=step)

  def finish(self, summary: dict[str, Any] | None = None, picture: str | None = None) -> None:
    """Adds the summary's figures and the report picture, then closes the run."""
    if self._run is None:  # No step trained in this attempt: it resumed at the end.
      self._open(resumed=True)
    if picture is not None:
      self._run.log({"report": self._wandb.Image(picture)})
    if summary:
      self._run.summary.update({k: v for k, v in summary.items()
                                if isinstance(v, (int, float, str, bool)) or v is None})
      self._run.summary.update(goodput_summary.flat(summary.get("goodput"),
                                                    summary.get("balancer_saving")))
    self.close()

  def close(self, exit_code: int = 0) -> None:
    """Ends the run and waits until W&B's service has written all of it.

    `run.finish` only informs the service, which writes on in the background;
    a job that leaves by `os._exit` (a stop, a lost host) skips wandb's atexit
    hook, so without `teardown` its last records could be lost.
    """
    self.run.finish(exit_code=exit_code)
    self._wandb.teardown(exit_code)
