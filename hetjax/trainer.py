"""The public Python API: `Trainer`, `train`, `params_digest`.

One `Trainer` runs every mode through one lifecycle (setup, agreement,
resume, `fit`, checkpoints, evaluation, signals, watchdog, summary, close);
what differs between modes is a strategy behind `hetjax.modes.base.Mode`:
`hetjax.Sync` (the default), `hetjax.Hybrid`, `hetjax.Elastic`, or your own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from hetjax import balancer as balancer_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.cluster.signals import Interrupted, Preempted, Stopped  # noqa: F401 (public names)
from hetjax.config import TrainConfig
from hetjax import mesh as mesh_lib
from hetjax import phases
from hetjax.input import data as data_lib
from hetjax.input import sources as sources_lib
from hetjax.modes.base import Mode, Setup
from hetjax.modes.sync import WARMUP_STEPS, Sync  # noqa: F401 (the report's warm-up matches it)
from hetjax.observe import metrics as metrics_lib
from hetjax.observe.history import History
from hetjax import task as task_lib
from hetjax.training import agreement
from hetjax.training import evaluate as evaluate_lib
from hetjax.training import lifecycle
from hetjax.training.lifecycle import params_digest  # noqa: F401 (public name)
from hetjax.task import Task
from hetjax.types import PyTree


class Trainer:
  """Data parallelism over whatever hosts this process belongs to, in any mode.

  Every host builds a Trainer with the same arguments, then calls `fit`. The
  mode's own attributes are `trainer.mode.X` (sync: `local_state`,
  `learning_rate()`, `balancer`, ...; rounds: `centre`, `host_params`, ...).

  Example (after `hetjax.initialize()`, on every host):
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer = hetjax.Trainer(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                          hetjax.TrainConfig(global_batch=32, microbatch=8))
    >>> trainer.fit(steps=2)["steps"], trainer.step
    (2, 2)
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, config: TrainConfig, *, mode: Mode | None = None,
               balancer: balancer_lib.Balancer | None = None,
               pace: Callable[[float, int, int], float] | None = None, identity: str = "",
               checkpoint: ckpt_lib.CheckpointConfig | None = None, data_workers: int = 0):
    """Validates everything, agrees with the other hosts, then builds the mode.

    Args:
      task: the model (`hetjax.from_functions`, `from_linen`, `from_nnx`).
      optimizer: any optax transformation (in a rounds mode, the hosts' inner one).
      source: random-access records (`len`, `source[indices] -> batch`).
      config: the settings every host must share.
      mode: how the hosts train together (default `hetjax.Sync()`).
      balancer, data_workers: `hetjax.Sync`'s, when `mode` is not given.
      pace: `pace(compute_s, step, samples) -> seconds to report`, for emulation
        only (default: from HETJAX_SPEED / HETJAX_SLOWDOWN / HETJAX_DEVICE_SAMPLE_MS).
      identity: extra text the hosts (and a resumed checkpoint) must agree on.
      checkpoint: where and how often to save; with `resume`, continues from the
        newest complete checkpoint there, whatever number of hosts wrote it.

    Raises:
      ValueError: a setting out of range, or hosts told different things.
    """
    lifecycle.check_joined("a Trainer")
    with lifecycle.watched(config), phases.within(phases.BUILDING):
      config.validate()
      if checkpoint is not None:
        checkpoint.validate()  # An unwritable folder fails before anything compiles.
      if mode is not None and (balancer is not None or data_workers):
        raise ValueError("`balancer` and `data_workers` are the sync mode's settings: give them "
                         "as mode=hetjax.Sync(balancer=..., data_workers=...).")
      self.mode = Sync(balancer, data_workers) if mode is None else mode
      # 'auto' becomes what the platform can do, so the modes see 'device' or 'host'.
      config = dataclasses.replace(config, reduction=mesh_lib.choose_reduction(config.reduction))
      self.task, self.optimizer, self.source, self.config = task, optimizer, source, config
      self.meshes = mesh_lib.Meshes.create(config.reduction)
      self.host_id, self.num_hosts = self.meshes.host_id, self.meshes.num_hosts
      self.sampler = data_lib.GlobalSampler(len(source), config.global_batch, config.seed,
                                            name=source.info.name)
      agreement.agree_on(f"{config!r}|{self.mode!r}|{source.info!r}|{len(source)}|{identity}|"
                         f"{checkpoint!r}", self.meshes, what="configuration", fix="(config hash "
                         "mismatch): every host must run the same command and arguments.")
      self.emulated, self.pace = lifecycle.pacing(pace, self.host_id)
      if self.emulated:  # A host short of CPU for its input (HETJAX_INPUT_SAMPLE_MS).
        from hetjax.cluster import emulate
        source = emulate.paced_input_from_env(source)
      example = source[np.arange(1)]
      task_lib.check_batch_keys(list(example))
      # Records that disagree with one another fail here, not mid-run.
      sources_lib.check_records(source, sources_lib.record_spec(source))
      self.history = History(warmup=self.mode.warmup, series={s: [] for s in self.mode.series})
      state, job = self.mode.build(Setup(task, optimizer, source, config, self.meshes, self.sampler,
                                         example, self.pace, self.history))
      self._evaluator: evaluate_lib.Evaluator | None = None  # Compiled once per batch size.
      self.resumed_from: int | None = None
      self.job = ckpt_lib.describe_job(state, {
          **job, "global_batch": config.global_batch, "seed": config.seed,
          "dataset": repr(source.info), "num_records": len(source), "identity": identity})
      self.checkpointer = lifecycle.checkpointer(checkpoint, self.meshes)
      if checkpoint is not None and checkpoint.resume:
        with phases.within(phases.RESTORING):
          self._resume()

  @property
  def state(self) -> Any:
    """The mode's state (sync: the train state; rounds: the centre); settable between steps."""
    return self.mode.state

  @state.setter
  def state(self, value: Any) -> None:
    self.mode.state = value

  @property
  def step(self) -> int:
    """The index of the next step (or round) to run; a dispatched step counts as run."""
    return self.mode.step

  @property
  def start_step(self) -> int:
    """The step this trainer started from: 0, or the checkpoint's it resumed."""
    return self.resumed_from or 0

  def check_params_agree(self) -> None:
    """Compares every host's fingerprint of what they must hold alike (every host calls
    it); raises `HostsDisagree` naming the hosts whose replicas differ."""
    with phases.within(phases.AGREEMENT, self.step):
      tree, what = self.mode.agreed()
      agreement.check_replicas(self.step, tree, self.meshes, what=what)

  def train_step(self) -> dict[str, float]:
    """Runs one step (or round) on every host, outside `fit`; returns its global metrics."""
    return next(iter(self.mode.advance(lifecycle.OneStep(self.step + 1)))).metrics

  def fit(self, steps: int | None = None, *, until: int | None = None, log_every: int = 0,
          log: Callable[[str], None] = print,
          on_step: Callable[["Trainer", dict[str, float]], None] | None = None,
          sinks: Sequence[Callable[[dict[str, Any]], Any]] = (), eval_every: int = 0,
          eval_source: data_lib.ArraySource | None = None, out: str | None = None) -> dict[str, Any]:
    """Runs `steps` more steps (rounds, in a rounds mode), or until step `until`.

    Saves every `every` steps and at the end, given a checkpoint folder.
    SIGTERM or Ctrl-C to any host stops every host at the same step boundary,
    saves, and raises `Preempted` or `Interrupted`. Callbacks, checks and
    evaluations run between steps, off the step clock.

    Args:
      steps: how many steps to run from here.
      until: the step to stop at (a resumed job runs only what is left).
      log_every: host 0 logs every this many steps (0: never).
      log: where log lines go.
      on_step: called after every step with the trainer and the step's metrics.
      sinks: fed each per-step record (`hetjax.observe.metrics` schema).
      eval_every: evaluate on `eval_source` every this many steps (0: only at the end).
      eval_source: the split to evaluate on (every host reads a slice).
      out: a run folder for summary.json, metrics.jsonl and TensorBoard (process 0).

    Returns:
      The summary (`summary()`), the same on every host.
    """
    with lifecycle.Run(self, steps, until=until, unit=self.mode.unit, log_every=log_every, log=log,
                       sinks=sinks, eval_every=eval_every, eval_source=eval_source, out=out,
                       every_step=on_step is not None, extra=self.mode.record_metrics) as run, \
        lifecycle.watched(self.config, self.host_id, self.num_hosts, run.unit):
      with run.watching(), phases.within(phases.TRAINING, self.step):
        for boundary in self.mode.advance(run):
          step = boundary.step
          if run.evaluation_due(step):
            run.evaluate()
          run.record()
          if on_step is not None:
            on_step(self, boundary.metrics)
          if boundary.stop:
            run.stop(boundary.stop)
          if run.check_due(step):
            self.check_params_agree()
          if run.save_due(step):
            self.save_checkpoint()
      run.evaluate_at_end()
      return run.close()

  def save_checkpoint(self, wait: bool = False) -> None:
    """Saves the state after `self.step` steps (every host must call it); the hosts'
    fingerprints are compared first: a checkpoint never records replicas that diverged."""
    if self.checkpointer is None:
      raise ValueError("this trainer has no checkpoint folder; pass checkpoint=CheckpointConfig(...).")
    with phases.within(phases.CHECKPOINT, self.step):
      self._save(wait)

  def _save(self, wait: bool) -> None:
    if self.checkpointer.last_saved != self.step:
      self.check_params_agree()
    state, world = self.mode.saved(background=not wait and self.checkpointer.config.async_save)
    if world is not None:
      self.checkpointer.save_in_background(self.step, state, self.checkpoint_meta(), world)
      return
    self.checkpointer.save(self.step, state, self.checkpoint_meta())
    if wait:
      self.checkpointer.wait()

  def checkpoint_meta(self) -> dict[str, Any]:
    """What a checkpoint after `self.step` steps records beside the state."""
    return {"job": self.job, "layout": self._layout(), **self.mode.meta()}

  def _layout(self) -> dict[str, Any]:
    """The host layout a checkpoint records; a resume compares it with its own."""
    return {"hosts": self.num_hosts, "devices_per_host": list(self.meshes.devices_per_host()),
            "microbatch": self.config.microbatch}

  def _resume(self) -> None:
    """Continues from the newest complete checkpoint of this job, if the folder has one."""
    resumed = self.mode.restore(self.checkpointer, self.job, self._layout())
    if resumed is None:
      return
    self.resumed_from, layout = resumed.step, resumed.meta["layout"]
    if self.host_id == 0:
      print(f"hetjax: resumed {resumed.label}from {self.checkpointer.directory}/{resumed.step} "
            f"(written by {layout['hosts']} host(s) x {layout['devices_per_host']} device(s))"
            f"{resumed.note}", flush=True)

  def summary(self, digest: bool = False) -> dict[str, Any]:
    """The figures of the run so far, identical on every host (per-host lists: the recent
    steps only; every step is in metrics.jsonl). `digest`: also hash every parameter (a
    copy of the whole model to host memory)."""
    with phases.within(phases.SUMMARY, self.step):
      fields = self.mode.summary_fields()  # First: the last steps' late figures arrive.
      return {**lifecycle.summary(self, digest=digest), **fields}

  def step_peak(self) -> dict[str, int | None] | None:
    """This host's step peak bytes per device (XLA's analysis of the largest program), and
    `unsharded`'s; None in the rounds modes."""
    return self.mode.step_peak() if hasattr(self.mode, "step_peak") else None

  def params(self) -> PyTree:
    """The current parameters as host numpy arrays (this host's copy)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), self.mode.current()[0])

  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]:
    """Mean loss and metrics over all of `source` (every host calls it), streamed
    `batch_size` records per device, spread over the hosts by their last step's shares."""
    weights = self.history.shares[-1] if self.history.shares else [1] * self.num_hosts
    with phases.within(phases.EVALUATION, self.step):
      if self._evaluator is None or self._evaluator.batch != batch_size * self.meshes.local_devices:
        self._evaluator = evaluate_lib.Evaluator(self.task, self.meshes, batch_size)
      return self._evaluator.evaluate(*self.mode.current(), source, weights)

  def write_summary(self, out: str, summary: dict[str, Any]) -> None:
    """Writes OUT/summary.json on process 0 (what `hetjax report` reads)."""
    if self.host_id == 0:
      metrics_lib.write_summary(out, summary)

  def close(self) -> None:
    """Stops the mode's threads and finishes any checkpoint being written."""
    self.mode.close()
    if self.checkpointer is not None:
      with lifecycle.watched(self.config, self.host_id, self.num_hosts), \
          phases.within(phases.CHECKPOINT, self.step):
        self.checkpointer.wait()
      self.checkpointer.close()


def train(task: Task, optimizer: optax.GradientTransformation, source: data_lib.ArraySource,
          *, global_batch: int, steps: int, **config: Any) -> tuple[Trainer, dict[str, Any]]:
  """One call: build a `Trainer` from keyword settings and run `steps` steps.

  Args:
    task, optimizer, source: as for `Trainer`.
    global_batch: samples per step over all hosts.
    steps: how many steps to run.
    **config: any other `TrainConfig` field, e.g. `microbatch=8`.

  Returns:
    (the trainer, its summary).

  Example:
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer, summary = hetjax.train(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                                 global_batch=32, microbatch=8, steps=2)
    >>> summary["last_step"]
    2
  """
  trainer = Trainer(task, optimizer, source, TrainConfig(global_batch=global_batch, **config))
  return trainer, trainer.fit(steps)
