"""The training loop and the public Python API.

The loop, one step at a time (DESIGN.md, "One step, as the data flows"):
balancer -> this host's share -> its slice of the global batch -> LOCAL
program -> measured (and, under emulation, paced) compute seconds -> the
cross-host reduction, which also carries every host's timings -> balancer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax

from hetjax import agreement
from hetjax import augment as augment_lib
from hetjax import balancer as balancer_lib
from hetjax import blocks as blocks_lib
from hetjax import checkpoint as ckpt_lib
from hetjax import data as data_lib
from hetjax import evaluate as evaluate_lib
from hetjax import loader as loader_lib
from hetjax import metrics as metrics_lib
from hetjax import precision as precision_lib
from hetjax import readiness
from hetjax import runtime
from hetjax import signals
from hetjax import sources as sources_lib
from hetjax import step as step_lib
from hetjax import task as task_lib
from hetjax.history import History
from hetjax.signals import Interrupted, Preempted, Stopped  # noqa: F401 (public names)
from hetjax.task import Task

PyTree = Any
WARMUP_STEPS = 2  # Steps excluded from throughput: compilation and first transfers.
# Set by the launchers' emulation flags; named here so that `hetjax.emulate`
# is imported only when something is emulated.
_EMULATION_ENV = ("HETJAX_SPEED", "HETJAX_SLOWDOWN", "HETJAX_DEVICE_SAMPLE_MS")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What every host must agree on (compared by hash before training).

  Attributes:
    global_batch: samples per step over all hosts; fixed for the whole run.
    microbatch: samples per device per micro-batch, `m`: the global batch is
      cut into blocks of `m` positions, each run whole by one device, so a
      host's share is a whole number of blocks (`hetjax.blocks`).
    seed: seeds the parameters and the data order.
    assignment: 'equal' (in blocks) or explicit per-host shares in samples
      whose boundaries fall on blocks, e.g. (4, 24, 36) with microbatch 4.
    reduction: cross-host reduction backend, 'device' or 'host'.
    balancer: None (follow `assignment`), 'equal', 'static' (profile a short
      warm-up, then fix the split) or 'dynamic' (keep re-sizing shares from
      the measured step times).
    augment: per-example augmentation, e.g. 'crop,flip' (see hetjax.augment);
      its randomness follows the example's global index, not the host.
    check_every: compare every host's parameter fingerprint every this many
      steps and at every checkpoint (0: only at checkpoints).
  """

  global_batch: int
  microbatch: int = 16
  seed: int = 0
  assignment: str | tuple[int, ...] = "equal"
  reduction: str = "device"
  balancer: str | None = None
  augment: str = "none"
  check_every: int = 100
  precision: str = "fp32"

  def validate(self) -> None:
    if self.global_batch < 1:
      raise ValueError(f"global batch must be >= 1, got {self.global_batch}.")
    if self.microbatch < 1:
      raise ValueError(f"micro-batch must be >= 1, got {self.microbatch}.")
    if self.reduction not in step_lib.REDUCTIONS:
      raise ValueError(f"unknown reduction backend {self.reduction!r}; choose 'device' or 'host'.")
    augment_lib.parse(self.augment)  # Raises on an unknown augmentation.
    precision_lib.check(self.precision)
    if not isinstance(self.assignment, str):
      blocks_lib.check_aligned(self.assignment, self.global_batch, self.microbatch)
    if self.check_every < 0:
      raise ValueError(f"check_every must be >= 0 steps (0: only at checkpoints), got "
                       f"{self.check_every}.")


def params_digest(params: PyTree) -> str:
  """sha256 over the float32 bytes of the parameter leaves, in tree order."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf, dtype=np.float32)).tobytes())
  return h.hexdigest()


_fingerprint = agreement.text_fingerprint


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
        differ between hosts (see `hetjax.loader`).
    """
    if int(os.environ.get(runtime.ENV_NUM_HOSTS, "1")) > 1 and not runtime.is_initialized():
      raise RuntimeError(f"{runtime.ENV_NUM_HOSTS} asks for several hosts but the cluster is not joined: "
                         "call hetjax.initialize() before building a Trainer.")
    config.validate()
    if checkpoint is not None:
      checkpoint.validate()  # An unwritable folder fails before anything compiles.
    self.task, self.optimizer, self.source, self.config = task, optimizer, source, config
    self.meshes = step_lib.Meshes.create()
    self.host_id, self.num_hosts = self.meshes.host_id, self.meshes.num_hosts
    self._custom_balancer = balancer is not None
    self.balancer = balancer or self._default_balancer(start_step=0)
    self.sampler = data_lib.GlobalSampler(len(source), config.global_batch, config.seed,
                                          name=source.info.name)
    self._check_hosts_agree(f"{identity}|{checkpoint!r}")
    self.emulated = pace is not None or any(k in os.environ for k in _EMULATION_ENV)
    if pace is None and self.emulated:
      from hetjax import emulate  # Emulation stays off the real path.
      pace = emulate.pacing_from_env(self.host_id)
    self.pace = pace
    self.loader = loader_lib.HostLoader(source, self.sampler, self.host_id, workers=data_workers,
                                        augment=augment_lib.parse(config.augment))
    self._example = source[np.arange(1)]
    task_lib.check_batch_keys(list(self._example))
    # Records that disagree with one another fail here, not mid-run.
    sources_lib.check_records(source, sources_lib.record_spec(source))
    init_batch = next(step_lib.micro_batches(self._example, config.microbatch))
    self.state = step_lib.init_state(task, optimizer, self.meshes, init_batch, config.seed,
                                     config.precision)
    self._check_contract(init_batch)
    self.local = step_lib.LocalProgram(task, self.meshes, config.microbatch, config.precision)
    self.reduction = step_lib.make_reduction(config.reduction, optimizer, self.meshes)
    self.history = History()
    self._last_wait = 0.0
    self._last_compute: float | None = None  # This host's, for the next step's reduction.
    self._clock = readiness.ReadyClock()
    self._timing = None  # (t0, t2, future of the sums' readiness) of the last step.
    self._start_step = 0
    self._base_key = jax.random.key(config.seed)
    self._stop_code = 0.0  # The largest stop signal any host sent (hetjax.signals).
    self._evaluator: evaluate_lib.Evaluator | None = None
    self.resumed_from: int | None = None
    self.job = ckpt_lib.describe_job(self.state, {
        "global_batch": config.global_batch, "seed": config.seed,
        "dataset": repr(source.info), "num_records": len(source), "identity": identity})
    # The model and optimizer too: a stale checkout with the same command line differs here.
    self._agree_on(ckpt_lib.describe_job(self.state, {}), what="model or optimizer",
                   fix="parameter shapes or optimizer state structure differ; every host must "
                   "run the same code (check each host's checkout and installed packages).")
    self.checkpointer = None
    if checkpoint is not None:
      self.checkpointer = ckpt_lib.Checkpointer(checkpoint, self._all_hosts_agree)
      if checkpoint.resume:
        self._resume()

  def _default_balancer(self, start_step: int) -> balancer_lib.Balancer:
    """The configured policy, deciding in blocks (one device round = granularity)."""
    config = self.config
    options = {}
    if config.balancer in ("static", "dynamic"):
      options["start_step"] = start_step
    return blocks_lib.make_block_balancer(
        config.assignment, config.global_batch, config.microbatch,
        self.meshes.devices_per_host(), mode=config.balancer, **options)

  def _check_contract(self, block: dict[str, np.ndarray]) -> None:
    """Per-example losses and metrics, checked abstractly before anything runs."""
    rng = jax.random.key(0)
    args = (self.state.params, self.state.model_state, block, rng)
    task_lib.check_contract(self.task.loss, *args)
    if self.task.eval_loss is not None:
      task_lib.check_contract(self.task.eval_loss, *args, what="the task's evaluation loss")

  def _all_hosts_agree(self, flag: bool) -> bool:
    flags = step_lib.gather_host_values(np.array([float(flag)]), self.meshes)
    return bool(np.all(flags > 0))

  def _layout(self) -> dict[str, Any]:
    return {"hosts": self.num_hosts, "devices_per_host": list(self.meshes.devices_per_host()),
            "microbatch": self.config.microbatch}

  def _checkpoint_meta(self) -> dict[str, Any]:
    meta = {"job": self.job, "layout": self._layout(), "data": self.sampler.state_dict(self.step)}
    if hasattr(self.balancer, "state_dict"):
      meta["balancer"] = self.balancer.state_dict()
    return meta

  def _resume(self) -> None:
    """Continues from the newest complete checkpoint, if the folder has one."""
    restored = self.checkpointer.restore_latest(self.state, self.job)
    if restored is None:
      return
    self.state, meta = restored
    step = self.sampler.restore(meta["data"])
    self._start_step = self.resumed_from = step
    try:
      if meta["layout"] != self._layout() or "balancer" not in meta:
        raise ValueError("another host layout")
      self.balancer.load_state_dict(meta["balancer"])
    except (ValueError, AttributeError):
      # Another layout or policy: the old timings say nothing about these
      # hosts, so a profiling balancer warms up afresh from this step.
      if not self._custom_balancer:
        self.balancer = self._default_balancer(start_step=step)
    if self.host_id == 0:
      print(f"hetjax: resumed from {self.checkpointer.directory}/{step} (written by "
            f"{meta['layout']['hosts']} host(s) x {meta['layout']['devices_per_host']} device(s))",
            flush=True)

  def _check_hosts_agree(self, identity: str) -> None:
    mine = f"{self.config!r}|{self.source.info!r}|{len(self.source)}|{identity}"
    self._agree_on(mine, what="configuration",
                   fix="(config hash mismatch): every host must run the same command and arguments.")

  def _agree_on(self, description: Any, *, what: str, fix: str) -> None:
    everyone = step_lib.gather_host_values(
        agreement.text_fingerprint(repr(description)), self.meshes)
    agreement.check_all_equal(everyone, what=what, fix=fix)

  def check_params_agree(self) -> None:
    """Compares every host's parameter fingerprint (every host must call it).

    Raises:
      agreement.HostsDisagree: naming the hosts whose replicas differ.
    """
    local = jax.tree.map(lambda x: step_lib.to_local(x, self.meshes), self.state.params)
    rows = step_lib.gather_host_values(agreement.params_fingerprint(local), self.meshes)
    agreement.check_fingerprints(self.step, rows)

  @property
  def step(self) -> int:
    """The index of the next step to run."""
    return self._start_step + self.history.steps

  def train_step(self) -> dict[str, float]:
    """Runs one synchronous step on every host; returns the global metrics.

    Nothing waits for the devices between the local programs and the
    reduction: a helper thread times the local compute, and the seconds
    travel in the next step's reduction (the balancer sees them one step
    late, the same on every host). Under emulation the pacing still waits.
    """
    step = self.step
    self._settle_timing()
    t0 = time.perf_counter()
    block = self.config.microbatch
    shares = blocks_lib.check_aligned(balancer_lib.validate_shares(
        self.balancer.shares(step), self.config.global_batch, self.num_hosts),
        self.config.global_batch, block)
    batch = self.loader.get(step, shares)
    self.loader.prefetch(step + 1, shares)  # A guess: shares rarely change.
    sums = self.local(self.state.params, self.state.model_state, batch, self._example,
                      self._base_key, step, blocks_lib.first_block(shares, self.host_id, block),
                      self.state.loss_scale.scale)
    if self.pace is None:
      ready = self._clock.watch(sums)
    else:
      jax.block_until_ready(sums)
      unit = self.config.microbatch * self.meshes.local_devices
      paced = self.pace(time.perf_counter() - t0, step, -(-shares[self.host_id] // unit) * unit)
    t1 = time.perf_counter()
    # Timings (this host's of the previous step: measured off the critical path),
    # its stop signal and the shares it used, for every host to check.
    previous = self._last_compute
    host_values = np.array([previous or 0.0, self._last_wait, signals.REQUESTS.code, *shares])
    self.state, stats, rows = self.reduction(self.state, sums, host_values)
    agreement.check_shares(step, rows[:, 3:3 + self.num_hosts])  # The reduction appends an overflow column.
    self._stop_code = float(rows[:, 2].max())
    t2 = time.perf_counter()
    if self.pace is None:
      self._timing = (t0, t2, ready)  # Read at the next step, long after it is known.
    else:
      self._last_compute, self._last_wait = paced, t2 - t1
    if stats["count"] <= 0:
      raise RuntimeError(f"step {step}: the hosts processed 0 examples in total; the "
                         f"assignment {shares} must give the global batch at least one sample.")
    h = self.history
    h.shares.append(shares)
    if previous is not None:  # Every host's compute and wait seconds of the previous step.
      if h.dropped + len(h.compute_s) < h.steps - 1:  # Not yet gathered by summary().
        h.compute_s.append([float(r) for r in rows[:, 0]])
        h.wait_s.append([float(r) for r in rows[:, 1]])
      self.balancer.observe(step - 1, h.shares[-2], rows[:, 0].tolist())
    h.step_s.append(t2 - t0)
    metrics = {k: float(v) for k, v in stats.items() if k != "count"}
    h.loss.append(metrics["loss"])
    h.metrics.append(metrics)
    return metrics

  def fit(self, steps: int | None = None, *, until: int | None = None, log_every: int = 0,
          log: Callable[[str], None] = print,
          on_step: Callable[["Trainer", dict[str, float]], None] | None = None,
          sinks: Sequence[Callable[[dict[str, Any]], Any]] = (), eval_every: int = 0,
          eval_source: data_lib.ArraySource | None = None, out: str | None = None) -> dict[str, Any]:
    """Runs `steps` more steps, or until step `until`; returns the summary (same on every host).

    With a checkpoint folder it saves every `every` steps and at the end.
    SIGTERM or Ctrl-C (SIGINT) to any host makes every host stop at the next
    step boundary, save when there is a checkpoint folder, and raise
    `Preempted` (SIGTERM) or `Interrupted` (SIGINT).

    Args:
      steps: how many steps to run from here.
      until: the step to stop at (a resumed job runs only what is left).
      log_every: host 0 logs every this many steps (0: never).
      log: where log lines go.
      on_step: called after every step with the trainer and the step's metrics.
      sinks: fed one complete per-step record each (`hetjax.metrics` schema),
        e.g. `MetricsWriter.write` or `Progress.update`; a step's record
        comes one step late, when its wait seconds are known.
      eval_every: evaluate on `eval_source` every this many steps (0: only
        at the end, when `eval_source` is given); the figures go into the
        records (`eval`) and the summary, the time spent off the step clock.
      eval_source: the split to evaluate on (every host reads a slice).
      out: a run folder: process 0 writes summary.json, metrics.jsonl and
        TensorBoard events there, as `hetjax train --out` does, so
        `hetjax report OUT` reads API runs too.
    """
    if (steps is None) == (until is None):
      raise ValueError("give fit() exactly one of steps (how many more) or until (the last step).")
    if steps is not None and steps < 0:
      raise ValueError(f"steps must be >= 0, got {steps}.")
    if eval_every < 0:
      raise ValueError(f"eval_every must be >= 0 steps (0: evaluate only at the end), got {eval_every}.")
    if eval_every and eval_source is None:
      raise ValueError(f"eval_every={eval_every} needs eval_source, the split to evaluate on.")
    target = self.step + steps if until is None else until
    writer = None
    if out is not None and self.host_id == 0:
      writer = metrics_lib.MetricsWriter(out, resume_step=self.step or None)
      sinks = [*sinks, writer.write]
    # Records are built only for someone to read them: the step loop stays lean.
    stream = None if not sinks else metrics_lib.RecordStream(
        self.history, global_batch=self.config.global_batch, emulated=self.emulated,
        first_step=self._start_step, sinks=sinks)
    try:
      with signals.REQUESTS.installed():
        while self.step < target:
          metrics = self.train_step()
          if stream is not None:
            self.history.lr[self.history.steps - 1] = self.learning_rate()
          if eval_every and self.step % eval_every == 0:
            self._evaluate_into_history(eval_source)
          if stream is not None:
            stream.pop()
          self.history.trim(WARMUP_STEPS)  # Memory O(1) in steps: records are in the sinks.
          if on_step is not None:
            on_step(self, metrics)
          if log_every and self.step % log_every == 0 and self.host_id == 0:
            shown = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            log(f"step {self.step:5d} {shown} shares={','.join(map(str, self.history.shares[-1]))}")
          if self._stop_code:
            self._stop(stream, out)
          if self.config.check_every and self.step % self.config.check_every == 0:
            self.check_params_agree()
          if self.checkpointer is not None and self.step % self.checkpointer.config.every == 0:
            self.save_checkpoint()
      # Also when nothing was left to run (a finished job started again).
      if eval_source is not None and (self.history.steps - 1) not in self.history.evals:
        self._evaluate_into_history(eval_source)
      if self.checkpointer is not None:
        self.save_checkpoint(wait=True)
      summary = self.summary()
      if stream is not None:
        stream.pop()  # The last step's record, now that summary() gathered its waits.
      if out is not None:
        self.write_summary(out, summary)
      return summary
    finally:
      if writer is not None:
        writer.close()

  def _stop(self, stream: metrics_lib.RecordStream | None, out: str | None) -> None:
    """Every host got the stop flag in the same step: save, write what is known, raise."""
    code, self._stop_code = self._stop_code, 0.0
    signals.REQUESTS.clear()
    directory = None
    if self.checkpointer is not None:
      self.save_checkpoint(wait=True)
      directory = self.checkpointer.directory
    summary = self.summary()
    if stream is not None:
      stream.pop()
    if out is not None:
      self.write_summary(out, summary)
    raise signals.stopped(code, self.step, directory)

  def _evaluate_into_history(self, source: data_lib.ArraySource) -> None:
    figures = self.evaluate(source)
    self.history.evals[self.history.steps - 1] = figures

  def learning_rate(self) -> float | None:
    """The learning rate of the last update, when the optimizer exposes it.

    Found in an `optax.inject_hyperparams` state (the command line builds its
    optimizers that way); None for an optimizer that hides it.
    """
    lr = _find_learning_rate(self.state.opt_state)
    return None if lr is None else float(np.asarray(lr.addressable_data(0)))

  def write_summary(self, out: str, summary: dict[str, Any]) -> None:
    """Writes OUT/summary.json on process 0 (what `hetjax report` reads)."""
    if self.host_id == 0:
      metrics_lib.write_summary(out, summary)

  def close(self) -> None:
    """Stops the input threads and finishes any checkpoint being written."""
    self.loader.close()
    self._clock.close()
    if self.checkpointer is not None:
      self.checkpointer.wait()
      self.checkpointer.close()

  def save_checkpoint(self, wait: bool = False) -> None:
    """Saves the state after `self.step` steps (every host must call it).

    The hosts' parameter fingerprints are compared first: a checkpoint never
    records replicas that diverged.
    """
    if self.checkpointer is None:
      raise ValueError("this trainer has no checkpoint folder; pass checkpoint=CheckpointConfig(...).")
    if self.checkpointer.last_saved != self.step:
      self.check_params_agree()
    if wait or not self.checkpointer.config.async_save:
      self.checkpointer.save(self.step, self.state, self._checkpoint_meta())
      if wait:
        self.checkpointer.wait()
    else:  # A device copy; a worker thread hands it to orbax while training goes on.
      self.checkpointer.save_in_background(self.step, self.state, self._checkpoint_meta())

  def _settle_timing(self) -> None:
    """This host's compute and wait seconds of the last step, from the helper thread."""
    if self._timing is not None:
      t0, t2, ready = self._timing
      ready_at = ready.result()
      self._last_compute, self._last_wait, self._timing = ready_at - t0, t2 - ready_at, None

  def _final_waits(self) -> None:
    """The last step's compute and wait seconds travel in one extra small collective."""
    self._settle_timing()
    h = self.history
    if len(h.wait_s) < len(h.shares):  # The window keeps them aligned.
      rows = step_lib.gather_host_values(
          np.array([self._last_compute or 0.0, self._last_wait]), self.meshes)
      h.compute_s.append([float(r) for r in rows[:, 0]])
      h.wait_s.append([float(r) for r in rows[:, 1]])

  def summary(self, digest: bool = False) -> dict[str, Any]:
    """The figures of the run so far; identical on every host.

    Aggregates cover the whole run; the per-host lists (`batch`, `compute_s`,
    `wait_s`) only the recent steps the history keeps (`hetjax.history.WINDOW`):
    every step is in metrics.jsonl.

    Args:
      digest: also hash every parameter (`params_digest`): a copy of the
        whole model to host memory, so only on request.
    """
    self._final_waits()
    h = self.history
    steady, steady_s, busy_compute, busy_wait = h.steady_totals(WARMUP_STEPS, self.num_hosts)
    samples_per_sec = self.config.global_batch * steady / steady_s if steady_s > 0 else 0.0
    per_host = []
    for i in range(self.num_hosts):
      busy = busy_compute[i] + busy_wait[i]
      per_host.append({"batch": [s[i] for s in h.shares], "compute_s": [c[i] for c in h.compute_s],
                       "wait_s": [w[i] for w in h.wait_s],
                       "idle_fraction": busy_wait[i] / busy if busy else 0.0})
    return {
        "steps": h.steps,
        "last_step": self.step,
        "resumed_from": self.resumed_from,
        "global_batch": self.config.global_batch,
        "hosts": self.num_hosts,
        "devices_per_host": self.meshes.local_devices,
        "reduction": self.config.reduction,
        "balancer_mode": self.balancer.name,
        "balancer_decisions": list(getattr(self.balancer, "decisions", [])),
        "samples_per_sec": samples_per_sec,
        "final_loss": h.loss[-1] if h.loss else None,
        "final_metrics": h.metrics[-1] if h.metrics else {},
        "params_digest": params_digest(self.params()) if digest else None,
        "eval": self._last_eval(),
        "emulated_speeds": self.emulated,
        "per_host": per_host,
    }

  def params(self) -> PyTree:
    """The current parameters as host numpy arrays (this host's replica)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), self.state.params)

  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]:
    """Mean loss and metrics over all of `source`; every host must call it.

    Compiled once (parameters are arguments); the split is streamed
    `batch_size` records per device at a time and spread over every host
    (slices sized by the current shares, i.e. by speed) and its devices.
    """
    if self._evaluator is None or self._evaluator.batch != batch_size * self.meshes.local_devices:
      self._evaluator = evaluate_lib.Evaluator(self.task, self.meshes, batch_size)
    weights = self.history.shares[-1] if self.history.shares else [1] * self.num_hosts
    return self._evaluator.evaluate(self.state.params, self.state.model_state, source, weights)

  def _last_eval(self) -> dict[str, Any] | None:
    if not self.history.evals:
      return None
    index = max(self.history.evals)
    return {"step": self._start_step + index, **self.history.evals[index]}


def _find_learning_rate(opt_state: PyTree) -> jax.Array | None:
  """The `learning_rate` of the first `optax.inject_hyperparams` state in `opt_state`."""
  kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(node, kinds) and "learning_rate" in node.hyperparams:
      return node.hyperparams["learning_rate"]
  return None


def train(task: Task, optimizer: optax.GradientTransformation, source: data_lib.ArraySource,
          *, global_batch: int, steps: int, **config: Any) -> tuple[Trainer, dict[str, Any]]:
  """One call: build a `Trainer` from keyword settings and run `steps` steps."""
  trainer = Trainer(task, optimizer, source, TrainConfig(global_batch=global_batch, **config))
  return trainer, trainer.fit(steps)
