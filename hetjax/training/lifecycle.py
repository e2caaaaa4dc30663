"""The run lifecycle around `hetjax.Trainer.fit`, the same for every mode.

Every mode (sync, hybrid, elastic, yours: `hetjax.modes.base.Mode`) presents
a run the same way: the same `fit()` arguments, the same run folder
(metrics.jsonl, TensorBoard, summary.json), the same records and summary
fields, the same stop, save and evaluation bookkeeping. `Run` is one
`fit()` call; the pieces a Trainer is built with (pacing, the
checkpointer and its vote, the evaluator) are here too, so `trainer.py`
reads as the run's outline.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Callable, Iterator, NoReturn, Protocol, Sequence

import jax
import numpy as np

from hetjax import config as config_lib
from hetjax import mesh as mesh_lib
from hetjax import phases
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.cluster import runtime
from hetjax.cluster import signals
from hetjax.cluster import watchdog
from hetjax.input import data as data_lib
from hetjax.observe import goodput as goodput_lib
from hetjax.observe import goodput_record
from hetjax.observe import goodput_saving
from hetjax.observe import goodput_summary
from hetjax.observe import metrics as metrics_lib
from hetjax.observe import progress as progress_lib
from hetjax.observe.history import History

PyTree = Any
Sink = Callable[[dict[str, Any]], Any]


class Trained(Protocol):
  """What `Run` reads of a trainer (`hetjax.Trainer`); `step` counts the steps (or rounds) run."""

  config: Any
  meshes: mesh_lib.Meshes
  host_id: int
  num_hosts: int
  history: History
  emulated: bool
  pace: Callable[..., float] | None
  checkpointer: ckpt_lib.Checkpointer | None
  resumed_from: int | None

  @property
  def step(self) -> int: ...
  @property
  def start_step(self) -> int: ...
  def save_checkpoint(self, wait: bool = False) -> None: ...
  def summary(self, digest: bool = False) -> dict[str, Any]: ...
  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]: ...
  def params(self) -> PyTree: ...


# ---- building a trainer --------------------------------------------------------


def check_joined(what: str) -> None:
  """A multi-host launch must join the cluster before building `what`."""
  if int(os.environ.get(config_lib.Env.NUM_HOSTS, "1")) > 1 and not runtime.is_initialized():
    raise RuntimeError(f"{config_lib.Env.NUM_HOSTS} asks for several hosts but the cluster is not "
                       f"joined: call hetjax.initialize() before building {what}.")


def pacing(pace: Callable[..., float] | None, host_id: int) -> tuple[bool, Callable[..., float] | None]:
  """(emulated, pace): the given pace, or the launcher's emulation of this host's speed."""
  emulated = pace is not None or config_lib.emulated_from_env()
  if pace is None and emulated:
    from hetjax.cluster import emulate  # Emulation stays off the real path.
    pace = emulate.pacing_from_env(host_id)
  if os.environ.get(config_lib.Env.FAULTS):  # An emulated stall inside a step rides the pace.
    from hetjax.cluster import emulate
    pace = emulate.with_step_faults(pace, host_id)
  return emulated, pace


def checkpointer(checkpoint: ckpt_lib.CheckpointConfig | None,
                 meshes: mesh_lib.Meshes) -> ckpt_lib.Checkpointer | None:
  """The checkpointer of `checkpoint` (None without), voting over every host."""
  if checkpoint is None:
    return None
  faults = emulated_faults(meshes.host_id)
  return ckpt_lib.Checkpointer(checkpoint, lambda flag: all_hosts_agree(flag, meshes),
                               write_error=None if faults is None else faults.write_error)


def all_hosts_agree(flag: bool, meshes: mesh_lib.Meshes) -> bool:
  """True when every host says yes (the checkpointer's vote)."""
  flags = mesh_lib.gather_host_values(np.array([float(flag)]), meshes)
  return bool(np.all(flags > 0))


@contextlib.contextmanager
def watched(config: config_lib.TrainConfig, host_id: int | None = None,
            num_hosts: int | None = None, unit: str = "step") -> Iterator[None]:
  """The run-wide watchdog over the block (`hetjax.cluster.watchdog`): every phase announced
  inside it (building, restoring, steps, evaluation, checkpoints, agreement, the summary) has
  a deadline derived from `config.watchdog_s`. Nested blocks share the outer watch.

  Emulated faults (HETJAX_FAULTS, `hetjax.cluster.emulate`) are injected here, after the
  watchdog hears of each phase, so an emulated stall is watched like a real one.
  """
  host_id = jax.process_index() if host_id is None else host_id
  num_hosts = jax.process_count() if num_hosts is None else num_hosts
  with contextlib.ExitStack() as stack:
    stack.enter_context(watchdog.watching(config.watchdog_s, host_id, num_hosts, unit))
    faults = emulated_faults(host_id)
    if faults is not None:
      stack.enter_context(phases.PHASES.subscribe(faults))
    yield


def emulated_faults(host_id: int):
  """This host's emulated faults (a phase listener), or None when HETJAX_FAULTS names none."""
  if not os.environ.get(config_lib.Env.FAULTS):
    return None
  from hetjax.cluster import emulate  # Emulation stays off the real path.
  return emulate.faults_from_env(host_id)


# ---- one fit() call ----------------------------------------------------------


def check_fit_args(count: int | None, until: int | None, eval_every: int,
                   eval_source: data_lib.ArraySource | None, unit: str) -> None:
  """`fit()`'s argument checks; `unit` names what the run counts ('steps' or 'rounds')."""
  if (count is None) == (until is None):
    raise ValueError(f"give fit() exactly one of {unit} (how many more) or until (the last "
                     f"{unit[:-1]}).")
  if count is not None and count < 0:
    raise ValueError(f"{unit} must be >= 0, got {count}.")
  if eval_every < 0:
    raise ValueError(f"eval_every must be >= 0 {unit} (0: evaluate only at the end), got "
                     f"{eval_every}.")
  if eval_every and eval_source is None:
    raise ValueError(f"eval_every={eval_every} needs eval_source, the split to evaluate on.")


class Run:
  """One `fit()` call: run folder, sinks and records, evaluations, the stop, the save at the end.

  A context manager: the run folder's writer is closed however the run ends.

  Also what a mode's `advance` reads of the call (`hetjax.modes.base.Loop`):
  `target`, `due(step)`, `record()`, `records`; `hetjax.Trainer.fit` shows its use.
  """

  def __init__(self, trainer: Trained, count: int | None, *, until: int | None, unit: str,
               log_every: int = 0, log: Callable[[str], None] = print,
               sinks: Sequence[Sink] = (), eval_every: int = 0,
               eval_source: data_lib.ArraySource | None = None, out: str | None = None,
               every_step: bool = False, extra: Callable[[int], dict[str, float]] | None = None):
    """Checks `fit()`'s arguments and opens the run folder; `unit`: what `count` counts
    ('steps' or 'rounds'); `every_step`: stop at every boundary (an `on_step` callback);
    `extra`: a record's own metrics of a window entry (`metrics.RecordStream`)."""
    check_fit_args(count, until, eval_every, eval_source, unit)
    self.trainer, self.out, self.unit = trainer, out, unit[:-1]
    self.eval_every, self.eval_source = eval_every, eval_source
    self.every_step = every_step or trainer.pace is not None  # Paced steps run one by one.
    self.target = trainer.step + count if until is None else until
    sinks = list(sinks)
    if log_every:  # The progress line of `hetjax train`, through `log`.
      sinks.append(progress_lib.log_sink(self.target, host_id=trainer.host_id, every=log_every,
                                         log=log))
    self.writer = None
    if out is not None and trainer.host_id == 0:
      with phases.within(phases.BUILDING):  # Opening the folder, importing TensorBoard's writer.
        self.writer = metrics_lib.MetricsWriter(out, resume_step=trainer.step or None)
      sinks.append(self.writer.write)
    # Every host's phases and steps, for where the job's time went (hetjax.observe.goodput).
    self._recording = contextlib.ExitStack()
    self.recorder = self._recording.enter_context(goodput_record.for_fit(out, trainer.host_id))
    if self.recorder is not None:
      self.recorder.device(trainer.meshes.local.devices.flat[0].device_kind,
                           trainer.meshes.local_devices, trainer.config.precision, trainer.emulated)
      sinks.append(self.recorder.step_sink(trainer.host_id, getattr(trainer.mode, "flops_of", None)))
    # Records are built only for someone to read them: the loop stays lean.
    self.stream = None if not sinks else metrics_lib.RecordStream(
        trainer.history, global_batch=None, emulated=trainer.emulated,
        first_step=trainer.start_step, sinks=sinks, extra=extra)

  def __enter__(self) -> "Run":
    return self

  def __exit__(self, *exc: Any) -> None:
    if self.writer is not None:
      self.writer.close()
    self._recording.__exit__(*exc)  # A failed fit() leaves no close line: it did not end well.

  @contextlib.contextmanager
  def watching(self) -> Iterator[None]:
    """The loop's surroundings: stop signals caught, the watchdog on (`watched`)."""
    t = self.trainer
    with signals.REQUESTS.installed(), watched(t.config, t.host_id, t.num_hosts, self.unit):
      yield

  @property
  def records(self) -> bool:
    """Whether anyone reads the records (sinks, a log line, a run folder)."""
    return self.stream is not None

  def record(self) -> None:
    """Hands the complete records to the sinks (the history keeps itself bounded)."""
    if self.stream is not None:
      self.stream.pop()

  def evaluation_due(self, step: int) -> bool:
    return _every(self.eval_every, step)

  def check_due(self, step: int) -> bool:
    """Whether the hosts compare their replicas after `step` (`TrainConfig.check_every`)."""
    return _every(self.trainer.config.check_every, step)

  def save_due(self, step: int) -> bool:
    checkpointer = self.trainer.checkpointer
    return checkpointer is not None and _every(checkpointer.config.every, step)

  def due(self, step: int) -> bool:
    """Whether something happens at the boundary after `step` (the loop then waits there)."""
    return (self.every_step or self.evaluation_due(step) or self.check_due(step)
            or self.save_due(step))

  def evaluate(self) -> None:
    """Evaluates on the run's split; the figures join the last step's record."""
    h = self.trainer.history
    h.evals[h.steps - 1] = self.trainer.evaluate(self.eval_source)

  def evaluate_at_end(self) -> None:
    """The final evaluation, unless the last step had one (also when nothing was left to run)."""
    h = self.trainer.history
    if self.eval_source is not None and (h.steps - 1) not in h.evals:
      self.evaluate()

  def close(self) -> dict[str, Any]:
    """The end of `fit()`, finished or stopped: save (waiting), summarise, flush the records
    (the last one's wait seconds are known once `summary` gathered them), write."""
    with phases.within(phases.SUMMARY, self.trainer.step):
      return self._close()

  def _close(self) -> dict[str, Any]:
    t = self.trainer
    if t.checkpointer is not None:
      t.save_checkpoint(wait=True)
    summary = t.summary()
    if self.stream is not None:
      self.stream.pop()
    if self.recorder is not None:
      summary.update(goodput_fields(t, self.recorder))
    if hasattr(t.mode, "step_peak"):  # Every host's, so every host joins the gather.
      summary["step_peak_per_host"] = step_peaks(t.mode.step_peak(), t.meshes)
    if self.out is not None and t.host_id == 0:
      metrics_lib.write_summary(self.out, summary)
    return summary

  def stop(self, code: float) -> NoReturn:
    """Every host got the stop flag at this same boundary: close the run as `close`, raise."""
    signals.REQUESTS.clear()
    self.close()
    signals.REQUESTS.leave()
    t = self.trainer
    raise signals.stopped(code, t.step, None if t.checkpointer is None else t.checkpointer.directory)


class OneStep:
  """The `Loop` of a single step outside `fit` (`Trainer.train_step`): due at once, no records."""

  records = False

  def __init__(self, target: int):
    self.target = target

  def due(self, step: int) -> bool:
    del step
    return True

  def record(self) -> None:
    pass


def _every(n: int, step: int) -> bool:
  return bool(n) and step % n == 0


def summary(trainer: Trained, *, digest: bool) -> dict[str, Any]:
  """The summary fields of every mode (a mode adds its own: `Mode.summary_fields`); call after
  the history holds every step's wait seconds."""
  t, h = trainer, trainer.history
  evaluation = None
  if h.evals:
    index = max(h.evals)  # Steps done, as the records count.
    evaluation = {"step": t.start_step + index + 1, **h.evals[index]}
  return {
      "steps": h.steps,
      "last_step": t.step,
      "resumed_from": t.resumed_from,
      "global_batch": t.config.global_batch,
      "hosts": t.meshes.num_hosts,
      "devices_per_host": t.meshes.local_devices,
      "reduction": t.config.reduction,
      "samples_per_sec": h.samples_per_sec(h.warmup),
      "final_loss": h.loss[-1] if h.loss else None,
      "final_metrics": h.metrics[-1] if h.metrics else {},
      "params_digest": params_digest(t.params()) if digest else None,
      "eval": evaluation,
      "emulated_speeds": t.emulated,
      "per_host": h.per_host(t.num_hosts, h.warmup),
  }


def goodput_fields(trainer: Trained, recorder: goodput_record.Recorder) -> dict[str, Any]:
  """The summary's `goodput` (every host's record so far, gathered) and `balancer_saving`."""
  t, h = trainer, trainer.history
  attempts = goodput_lib.attempts_of(goodput_lib.read_lines(recorder.path))
  mine = goodput_summary.host_vector(goodput_lib.host_time(attempts, t.host_id, h.warmup))
  rows = mesh_lib.gather_host_values(np.asarray(mine, np.float32), t.meshes)
  goodput = goodput_summary.fields(rows.tolist())
  saving = None
  if getattr(getattr(t, "mode", None), "name", None) == "sync":  # Rounds price rounds, not splits.
    skip = max(0, h.warmup - h.dropped) if len(h.step_s) > h.warmup else 0
    end = min(len(h.shares), len(h.compute_s), len(h.wait_s))
    saving = goodput_saving.equal_split(
        h.shares[skip:end], h.compute_s[skip:end], h.wait_s[skip:end], h.step_s[skip:end],
        t.config.global_batch, steps=goodput["steps_run"], emulated=t.emulated)
  return {"goodput": goodput, "balancer_saving": goodput_summary.saving_fields(saving)}


def step_peaks(mine: dict[str, int | None], meshes: Any) -> list[dict[str, int | None]]:
  """Every host's `{'bytes', 'unsharded'}` step peak per device, gathered (exact: each
  figure travels as two float32 parts of 24 bits)."""
  parts = [p for k in ("bytes", "unsharded") for p in (
      (-1, 0) if mine[k] is None else divmod(int(mine[k]), 1 << 24))]
  rows = mesh_lib.gather_host_values(np.asarray(parts, np.float32), meshes)
  whole = lambda hi, lo: None if hi < 0 else int(hi) * (1 << 24) + int(lo)
  return [{"bytes": whole(*r[:2]), "unsharded": whole(*r[2:])} for r in rows.tolist()]


def params_digest(params: PyTree) -> str:
  """sha256 over the float32 bytes of the parameter leaves, in tree order.

  Two runs that reach the same parameters bit for bit (another host count,
  a resumed run) have the same digest.

  Args:
    params: a pytree of arrays (e.g. `Trainer.params()`).

  Returns:
    The hex digest.

  Example:
    >>> hetjax.params_digest({"w": np.zeros(2)}) == hetjax.params_digest({"w": np.zeros(2)})
    True
  """
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf, dtype=np.float32)).tobytes())
  return h.hexdigest()
