"""`hetjax train --wandb PROJECT`: the run in Weights & Biases, from host 0.

Host 0 logs the resolved configuration (what OUT/config.yaml holds), every
record OUT/metrics.jsonl gets (as the TensorBoard scalars: loss, samples/s,
metrics/*, eval/*, lr, host<i>/share, host<i>/compute_s, host<i>/wait_s, at
the record's step), the summary's figures (with where the job's time went:
goodput, badput_s/<cause>, host<i>/flops_per_s, balancer_saving/*), and the
report picture at the end. The other hosts log nothing: their records are the same.

`wandb` is an optional extra (`pip install 'hetjax[wandb]'`); `check_installed`
says so before JAX starts. `WANDB_MODE=offline` (or `disabled`), the API key
and the entity come from wandb's own environment variables. Console capture
is off: wandb would otherwise wrap stdout and stderr, which the progress
line and the launchers' per-host prefixes own.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hetjax.observe import goodput_summary
from hetjax.observe import metrics as metrics_lib

EXTRA = "pip install 'hetjax[wandb]'  (or: pip install wandb)"


def check_installed() -> None:
  """Raises ValueError naming what to install when the `wandb` library is missing."""
  if importlib.util.find_spec("wandb") is None:
    raise ValueError(f"--wandb logs to Weights & Biases, which needs the wandb library; "
                     f"install it with {EXTRA}, or drop --wandb.")


class WandbRun:
  """One W&B run fed like a metrics sink: `run(record)` per step, `finish()` at the end.

  Args:
    project: the W&B project.
    config: the resolved configuration (nested dicts, as OUT/config.yaml).
    out_dir: the run folder; wandb's own files go under OUT/wandb.
    name: the run's display name (default: W&B's own).
  """

  def __init__(self, project: str, config: dict[str, Any], out_dir: str, name: str | None = None):
    import wandb  # Only host 0 of a --wandb run pays for the import.

    self._wandb = wandb
    self.run = wandb.init(project=project, config=config, dir=out_dir, name=name,
                          settings=wandb.Settings(console="off"))

  def __call__(self, record: dict[str, Any]) -> None:
    """Logs one metrics record (`hetjax.observe.metrics` schema) at its step."""
    self.run.log(metrics_lib.scalars_of(record), step=int(record["step"]))

  def finish(self, summary: dict[str, Any] | None = None, picture: str | None = None) -> None:
    """Adds the summary's figures and the report picture, then closes the run."""
    if picture is not None:
      self.run.log({"report": self._wandb.Image(picture)})
    if summary:
      self.run.summary.update({k: v for k, v in summary.items()
                               if isinstance(v, (int, float, str, bool)) or v is None})
      # Where the job's time went: goodput, badput_s/<cause>, host<i>/flops_per_s, the saving.
      self.run.summary.update(goodput_summary.flat(summary.get("goodput"),
                                                   summary.get("balancer_saving")))
    self.run.finish()
