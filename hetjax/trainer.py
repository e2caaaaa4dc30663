"""The public Python API: `Trainer`, `train`, `params_digest`.

`Trainer` wires the pieces, each in its own module: this host's replica of
the train state (`hetjax.training.replica`), the step pipeline that
dispatches a step and finishes the one before (`hetjax.training.pipeline`),
and the run around `fit()` (`hetjax.training.lifecycle`), which the rounds
modes share.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import optax

from hetjax.config import TrainConfig  # noqa: F401 (public name)
from hetjax.training import agreement
from hetjax.input import augment as augment_lib
from hetjax import balancer as balancer_lib
from hetjax import blocks as blocks_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.input import data as data_lib
from hetjax.input import loader as loader_lib
from hetjax import optimizers as optimizers_lib
from hetjax.training import lifecycle
from hetjax.training.lifecycle import params_digest  # noqa: F401 (public name)
from hetjax.training import pipeline as pipeline_lib
from hetjax.training import sync_checkpoint
from hetjax.training.pipeline import StepPipeline
from hetjax.training.replica import Replica
from hetjax.input import sources as sources_lib
from hetjax import mesh as mesh_lib
from hetjax.step import device_batch as device_batch_lib
from hetjax.step import sharding as sharding_lib
from hetjax import step as step_lib
from hetjax import task as task_lib
from hetjax.observe.history import History
from hetjax.cluster.signals import Interrupted, Preempted, Stopped  # noqa: F401 (public names)
from hetjax.task import Task

PyTree = Any
WARMUP_STEPS = 2  # Steps excluded from throughput: compilation and first transfers.


class Trainer:
  """Synchronous data parallelism over whatever hosts this process belongs to.

  Example:
    >>> hetjax.initialize()
    >>> trainer = hetjax.Trainer(task, optax.adam(1e-3), source,
    ...                          hetjax.TrainConfig(global_batch=64))
    >>> summary = trainer.fit(steps=100)
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, config: TrainConfig, *,
               balancer: balancer_lib.Balancer | None = None,
               pace: Callable[[float, int], float] | None = None, identity: str = "",
               checkpoint: ckpt_lib.CheckpointConfig | None = None, data_workers: int = 0):
    """Validates everything, agrees with the other hosts, then initialises.

    Args:
      task: the model (`hetjax.from_functions`, `from_linen`, `from_nnx`).
      optimizer: any optax transformation.
      source: random-access records (`len`, `source[indices] -> batch`).
      config: the settings every host must share.
      balancer: overrides `config.assignment` with a custom split policy.
      pace: `pace(compute_s, step, samples) -> seconds to report`, called
        with each step's real local compute seconds and the samples this host
        computed (padded micro-batches); only for emulation (default: from
        HETJAX_SPEED / HETJAX_SLOWDOWN / HETJAX_DEVICE_SAMPLE_MS).
      identity: extra text the hosts must agree on (e.g. the command line);
        a checkpoint written under another identity is refused.
      checkpoint: where and how often to save; with `resume`, the trainer
        continues from the newest complete checkpoint there, also when it was
        written by another number of hosts.
      data_workers: input worker processes on this host (0: threads); may
        differ between hosts (see `hetjax.input.loader`).
    """
    lifecycle.check_joined("a Trainer")
    config.validate()
    if checkpoint is not None:
      checkpoint.validate()  # An unwritable folder fails before anything compiles.
    self.task, self.optimizer, self.source, self.config = task, optimizer, source, config
    self.meshes = mesh_lib.Meshes.create()
    self.host_id, self.num_hosts = self.meshes.host_id, self.meshes.num_hosts
    self._custom_balancer = balancer is not None
    self.sampler = data_lib.GlobalSampler(len(source), config.global_batch, config.seed,
                                          name=source.info.name)
    agreement.agree_on(f"{config!r}|{source.info!r}|{len(source)}|{identity}|{checkpoint!r}",
                       self.meshes, what="configuration", fix="(config hash mismatch): every "
                       "host must run the same command and arguments.")
    self.emulated, self.pace = lifecycle.pacing(pace, self.host_id)
    self.loader = loader_lib.HostLoader(source, self.sampler, self.host_id, workers=data_workers,
                                        augment=augment_lib.parse(config.augment),
                                        inline_below_s=loader_lib.INLINE_BELOW_S)
    example = source[np.arange(1)]
    task_lib.check_batch_keys(list(example))
    # Records that disagree with one another fail here, not mid-run.
    sources_lib.check_records(source, sources_lib.record_spec(source))
    init_batch = next(step_lib.micro_batches(example, config.microbatch))
    initial = step_lib.init_state(task, optimizer, self.meshes, init_batch, config.seed,
                                  config.precision)
    # Before any collective whose shapes follow the model's: a stale checkout
    # with the same command line must be named, not crash a collective.
    agreement.agree_on(ckpt_lib.describe_job(initial, {}), self.meshes, what="model or optimizer",
                       fix="parameter shapes or optimizer state structure differ; every host "
                       "must run the same code (check each host's checkout and installed packages).")
    # Each host's blocks per device per micro-batch (issue 27), every host's known.
    self.device_batches = device_batch_lib.for_hosts(config, task, initial.params,
                                                     initial.model_state, example, self.meshes)
    balancer = balancer or pipeline_lib.default_balancer(config, self.meshes, self.device_batches)
    self.reduction = step_lib.make_reduction(config.reduction, self.meshes)
    # Every slice of the state updated by one device, then gathered (issue 25):
    # replicas stay bit-identical on hosts that compile differently.
    self.sharded: sharding_lib.ShardedUpdate | None = None
    if not self.meshes.one_device:
      self.sharded = sharding_lib.ShardedUpdate(optimizer, *self.reduction.shard_mesh, initial)
      self.reduction.attach(self.sharded)
    self.local = step_lib.LocalProgram(
        task, optimizer, self.meshes, config.microbatch, config.precision,
        blocks_lib.every_block_whole(config.global_batch, config.microbatch),
        replica=None if self.sharded is None else self.sharded.replica_packer,
        device_batch=self.device_batches[self.host_id])
    self.replica = Replica(self.local, self.meshes, self.sharded,
                           optimizers_lib.find_learning_rate(initial.opt_state) is not None)
    self.replica.replace(initial)
    state = self.replica.global_view()  # Per-example losses, checked before anything runs.
    lifecycle.check_task(task, state.params, state.model_state, init_batch)
    lifecycle.warn_fast_variance(task, state.params, state.model_state, init_batch,
                                 self.device_batches, self.host_id)
    self.history = History()
    self.pipeline = StepPipeline(config, self.meshes, self.replica, self.reduction, self.loader,
                                 example, balancer, self.history, self.pace)
    self._evaluations = lifecycle.Evaluations(task, self.meshes)
    self.resumed_from: int | None = None
    self.job = ckpt_lib.describe_job(self.replica.global_view(), {
        "global_batch": config.global_batch, "seed": config.seed,
        "dataset": repr(source.info), "num_records": len(source), "identity": identity})
    self.checkpointer = lifecycle.checkpointer(checkpoint, self.meshes)
    if checkpoint is not None and checkpoint.resume:
      sync_checkpoint.resume(self, custom_balancer=self._custom_balancer)

  @property
  def state(self) -> step_lib.TrainState:
    """The train state after every dispatched step, as global replicated arrays.

    What orbax saves and what a user may inspect, keep or replace: the
    pending update is applied first and every leaf re-wrapped (zero-copy),
    so the step loop never reads it. The arrays stay valid after later
    steps (the next step donates a copy). A sharded update's optimizer
    state is gathered whole for the read (a copy).
    """
    return self.replica.lend(self.replica.global_view())

  @state.setter
  def state(self, state: step_lib.TrainState) -> None:
    """Replaces the train state (given as global replicated arrays, as `state` returns it).

    The arrays stay the caller's: the next step donates a copy of them.
    """
    self.replica.replace(state)
    self.replica.lend(None)

  @property
  def local_state(self) -> step_lib.TrainState:
    """This host's replica of the train state, on its own devices, every update applied.

    Valid after later steps, as `state` is; a sharded update's optimizer
    state gathered whole for the read (a copy; the run keeps it split).
    """
    return self.replica.lend(self.replica.settled())

  @property
  def balancer(self) -> balancer_lib.Balancer:
    """The split policy the steps follow (replaceable between steps)."""
    return self.pipeline.balancer

  @balancer.setter
  def balancer(self, balancer: balancer_lib.Balancer) -> None:
    self.pipeline.balancer = balancer

  @property
  def step(self) -> int:
    """The index of the next step to run (a dispatched step counts as run)."""
    return self.pipeline.step

  @property
  def start_step(self) -> int:
    """The step this trainer started from: 0, or the checkpoint's it resumed."""
    return self.pipeline.start_step

  def block_until_ready(self) -> "Trainer":
    """Waits until every dispatched step's work on this host's devices is done.

    For timing: unlike reading `state`, it does not apply the last step's
    update, which waits for the next step's first program (`local_state`).
    """
    self.replica.block_until_ready()
    return self

  def check_params_agree(self) -> None:
    """Compares every host's parameter fingerprint (every host must call it).

    Raises:
      agreement.HostsDisagree: naming the hosts whose replicas differ.
    """
    agreement.check_replicas(self.step, self.replica.applied().params, self.meshes)

  def train_step(self) -> dict[str, float]:
    """Runs one synchronous step on every host; returns its global metrics.

    `fit` overlaps steps instead: it fetches a step's metrics after
    dispatching the next one, so the devices never wait for Python.
    """
    return self.pipeline.one_step()

  def fit(self, steps: int | None = None, *, until: int | None = None, log_every: int = 0,
          log: Callable[[str], None] = print,
          on_step: Callable[["Trainer", dict[str, float]], None] | None = None,
          sinks: Sequence[Callable[[dict[str, Any]], Any]] = (), eval_every: int = 0,
          eval_source: data_lib.ArraySource | None = None, out: str | None = None) -> dict[str, Any]:
    """Runs `steps` more steps, or until step `until`; returns the summary (same on every host).

    With a checkpoint folder it saves every `every` steps and at the end.
    SIGTERM or Ctrl-C (SIGINT) to any host makes every host stop at the same
    step boundary (within two steps), save when there is a checkpoint folder,
    and raise `Preempted` (SIGTERM) or `Interrupted` (SIGINT).

    Steps overlap: a step's statistics are fetched after the next step is
    dispatched, so the devices never wait for Python. Where something
    happens (logging, evaluation, a check, a checkpoint, a stop, `on_step`),
    the loop first finishes the step in flight.

    Args:
      steps: how many steps to run from here.
      until: the step to stop at (a resumed job runs only what is left).
      log_every: host 0 logs every this many steps (0: never).
      log: where log lines go.
      on_step: called after every step with the trainer and the step's
        metrics (the loop then finishes every step before the next).
      sinks: fed one complete per-step record each (`hetjax.observe.metrics` schema),
        e.g. `MetricsWriter.write` or `Progress.update`; a step's record
        comes two steps late, when its wait seconds are known.
      eval_every: evaluate on `eval_source` every this many steps (0: only
        at the end, when `eval_source` is given); the figures go into the
        records (`eval`) and the summary, the time spent off the step clock.
      eval_source: the split to evaluate on (every host reads a slice).
      out: a run folder: process 0 writes summary.json, metrics.jsonl and
        TensorBoard events there, as `hetjax train --out` does, so
        `hetjax report OUT` reads API runs too.
    """
    pipeline, config = self.pipeline, self.config
    with lifecycle.Run(self, steps, until=until, unit="steps", warmup=WARMUP_STEPS,
                       log_every=log_every, log=log, sinks=sinks, eval_every=eval_every,
                       eval_source=eval_source, out=out, global_batch=config.global_batch) as run:
      every = lambda n, step: bool(n) and step % n == 0
      saves = 0 if self.checkpointer is None else self.checkpointer.config.every
      due = lambda step: (on_step is not None or self.pace is not None or run.evaluation_due(step)
                          or every(config.check_every, step) or every(saves, step))
      with run.watching():
        for step, metrics in pipeline.boundaries(run.target, due, run.record):
          if run.evaluation_due(step):
            run.evaluate()
          run.record()
          if on_step is not None:
            on_step(self, metrics)
          if pipeline.stopping():
            run.stop(pipeline.take_stop())
          if every(config.check_every, step):
            self.check_params_agree()
          if every(saves, step):
            self.save_checkpoint()
      if run.records and self.replica.shows_learning_rate:
        pipeline.settle_update()  # The last records carry the last update's learning rate.
      run.evaluate_at_end()
      return run.close()

  def learning_rate(self) -> float | None:
    """The learning rate of the last update, when the optimizer exposes it.

    Found in an `optax.inject_hyperparams` state (the command line builds its
    optimizers that way); None for an optimizer that hides it.
    """
    return self.replica.learning_rate()

  def write_summary(self, out: str, summary: dict[str, Any]) -> None:
    """Writes OUT/summary.json on process 0 (what `hetjax report` reads)."""
    lifecycle.write_summary(out, summary, self.host_id)

  def close(self) -> None:
    """Stops the input threads and finishes any checkpoint being written."""
    self.loader.close()
    self.pipeline.close()
    if self.checkpointer is not None:
      self.checkpointer.wait()
      self.checkpointer.close()

  def save_checkpoint(self, wait: bool = False) -> None:
    """Saves the state after `self.step` steps (every host must call it).

    The hosts' parameter fingerprints are compared first: a checkpoint never
    records replicas that diverged.
    """
    sync_checkpoint.save(self, wait)

  def summary(self, digest: bool = False) -> dict[str, Any]:
    """The figures of the run so far; identical on every host.

    Aggregates cover the whole run; the per-host lists (`batch`, `compute_s`,
    `wait_s`) only the recent steps the history keeps (`hetjax.observe.history.WINDOW`):
    every step is in metrics.jsonl.

    Args:
      digest: also hash every parameter (`params_digest`): a copy of the
        whole model to host memory, so only on request.
    """
    self.pipeline.final_waits()
    summary = lifecycle.summary(self, warmup=WARMUP_STEPS, balancer_mode=self.balancer.name,
                                balancer_decisions=list(getattr(self.balancer, "decisions", [])),
                                per_host=self.history.per_host(self.num_hosts, WARMUP_STEPS),
                                digest=digest)
    summary["memory_per_device"] = self.memory_per_device()
    summary["device_batches"] = list(self.device_batches)
    return summary

  def memory_per_device(self) -> dict[str, Any]:
    """Bytes of parameters, optimizer state and gradients one device holds, from the
    arrays' sizes: `unsplit` (every device updating a whole replica) and, when the
    update is sharded, `split` over `split_over` devices (`hetjax.step.sharding`)."""
    return self.replica.memory_per_device(self.config.reduction, self.optimizer)

  def params(self) -> PyTree:
    """The current parameters as host numpy arrays (this host's replica)."""
    return lifecycle.host_copy(self.replica.applied().params)

  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]:
    """Mean loss and metrics over all of `source`; every host must call it.

    Compiled once (parameters are arguments); the split is streamed
    `batch_size` records per device at a time and spread over every host
    (slices sized by the current shares, i.e. by speed) and its devices.
    """
    weights = self.history.shares[-1] if self.history.shares else [1] * self.num_hosts
    state = self.replica.applied()
    return self._evaluations.evaluate(state.params, state.model_state, source, weights, batch_size)


def train(task: Task, optimizer: optax.GradientTransformation, source: data_lib.ArraySource,
          *, global_batch: int, steps: int, **config: Any) -> tuple[Trainer, dict[str, Any]]:
  """One call: build a `Trainer` from keyword settings and run `steps` steps."""
  trainer = Trainer(task, optimizer, source, TrainConfig(global_batch=global_batch, **config))
  return trainer, trainer.fit(steps)
