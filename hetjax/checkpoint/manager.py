"""Checkpoints of the whole train state with orbax (docs/design.md invariant 5).

A checkpoint is one orbax step folder with two items:
- `state`: the `TrainState` (step, parameters, optimizer state, model state)
  as global replicated arrays, which orbax saves once for the whole job and
  can restore onto another mesh (another number of hosts or devices);
- `meta`: JSON with what the arrays do not say: the job description (to
  refuse a checkpoint of another model or optimizer), the data cursor, the
  balancer state and the host layout that wrote it.

The RNG needs no entry: every key is the seed's folded with the step (and
block), so (seed, step) is the whole RNG state. Every host calls every method
in the same order (orbax's multi-host contract); which checkpoint loads is
agreed through a collective.

An asynchronous save stalls the loop only for a snapshot (`snapshot`); a
worker thread hands it to orbax (bookkeeping that grows with the number of
arrays). The worker may run beside the training collectives because every
orbax barrier goes through the coordination service's key-value store
(`active_processes` = every host): orbax's default barrier is an all-gather
over every device, which from a second thread meets the training programs in
different orders on different hosts (tried: gloo aborts with "collective
mismatch"). The workers run the same saves in the same order, so their
barriers match.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import time
from typing import Any, Callable

import jax
from jax.sharding import Mesh
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from hetjax.checkpoint import commits
from hetjax.checkpoint import quiet
from hetjax.checkpoint import snapshot as snapshot_lib
from hetjax.checkpoint import write_failed
from hetjax.checkpoint.jobs import describe_job, job_differences  # noqa: F401 (public names)
from hetjax.checkpoint.write_failed import (  # noqa: F401 (public names)
    WRITE_FAILED_EXIT, CheckpointWriteFailed, WriteError)
from hetjax.cluster import watchdog
from hetjax.config import CheckpointConfig, is_remote, resolve  # noqa: F401 (public names)

FORMAT = 1
# TrainState fields a checkpoint may lack because it predates them: each is
# filled from the fresh state of this run (for `loss_scale`, the default
# scale of the run's precision: 1 in fp32/bf16, 2^15 in fp16).
ADDED_FIELDS = ("loss_scale",)
_COMMIT_MARKER = "commit_success.txt"  # Written by orbax when a step folder is complete.
DAMAGED_SUFFIX = ".damaged"  # A skipped step folder is renamed STEP.damaged, kept for inspection.
log = logging.getLogger("hetjax.checkpoint")


class Checkpointer:
  """An orbax `CheckpointManager` for hetjax train states.

  A write that fails on one host, in orbax's background commit too, goes at once to the
  watchdog, which ends every host with `WRITE_FAILED_EXIT` (the others would otherwise
  wait in orbax's barrier for its whole timeout).

  `agree(flag)`: True when every host's flag is (a collective): whether a checkpoint loaded
  everywhere. `write_error(step)`: EMULATED faults only (`emulate.Faults.write_error`), the
  error this host's write of `step` fails with inside orbax's commit, or None.
  """

  def __init__(self, config: CheckpointConfig, agree: Callable[[bool], bool], *,
               write_error: Callable[[int], BaseException | None] | None = None):
    config.validate()
    self.config = config
    self.directory = resolve(config.directory)
    self._path = epath.Path(self.directory)
    self._agree = agree
    # Barriers through the key-value store (module docstring); `validate` made the folder.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.keep, create=False, enable_async_checkpointing=config.async_save,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))))
    # Handlers named up front so `item_metadata` tells an older checkpoint's fields.
    quiet.install()
    self._reported: set[int] = set()  # Steps whose failure the watchdog ends the job with.
    self._state_handler = commits.ReportingHandler(self._report, write_error)
    self._manager = ocp.CheckpointManager(
        self._path, options=options,
        item_handlers={"state": self._state_handler.handler,
                       "meta": ocp.JsonCheckpointHandler()})
    self.last_saved: int | None = None
    self._handed: list[int] = []  # Steps handed to orbax; a background write may fail later.
    self._snapshots = snapshot_lib.SnapshotTaker()
    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-ckpt")
    self._handing_over: concurrent.futures.Future | None = None
    self.snapshot_s: list[float] = []  # Seconds each snapshot blocked the caller.
    self.handover_s: list[float] = []  # Seconds each hand-over spent in orbax (on the worker).
    # Seconds each background save waited for the previous hand-over (saves too close stall).
    self.handover_wait_s: list[float] = []

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Hands the state after `step` steps to orbax on this thread (written in the background
    if async); `state` must not be donated until this returns. A save that failed on any host
    raises `CheckpointWriteFailed` on every host."""
    failure = self._finished_hand_over()
    if failure is None and step != self.last_saved:
      try:
        self._hand_over(step, state, meta)
        self.last_saved = step
      except WriteError as e:
        failure = e
    self._raise_if_any_failed(failure)

  def save_in_background(self, step: int, state: Any, meta: dict[str, Any],
                         hosts: Mesh | None = None) -> None:
    """Saves the state after `step` steps, blocking only for a snapshot of it, so the caller
    may donate `state` at once (`hosts`: as `SnapshotTaker.take`). Waits first for the
    previous hand-over (a fraction of a step; saves are many steps apart)."""
    t0 = time.perf_counter()
    self._raise_if_any_failed(self._finished_hand_over())
    self.handover_wait_s.append(time.perf_counter() - t0)
    if step == self.last_saved:
      return
    t0 = time.perf_counter()
    snapshot = self._snapshots.take(state, hosts)
    self.snapshot_s.append(time.perf_counter() - t0)
    self.last_saved = step
    self._handing_over = self._worker.submit(
        lambda: self._hand_over(step, snapshot.as_global(), meta))

  def _hand_over(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """orbax's save; its error (this one, or an earlier background write's) as a `WriteError`."""
    t0 = time.perf_counter()
    meta = {"format": FORMAT, "step": step, **meta}
    self._state_handler.step = step
    try:
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state._asdict()), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except
      raise WriteError(step, e, _nbytes(state)) from e
    self._handed.append(step)
    self.handover_s.append(time.perf_counter() - t0)

  def _finished_hand_over(self) -> WriteError | None:
    """Waits for the worker's hand-over; its failure, if any (other errors re-raised)."""
    handing_over, self._handing_over = self._handing_over, None
    if handing_over is None:
      return None
    try:
      handing_over.result()
    except WriteError as e:
      return e
    return None

  def _raise_if_any_failed(self, failure: WriteError | None) -> None:
    """Every host stops together when a write failed on any of them (a collective)."""
    if failure is not None and self._reported:
      watchdog.WATCHDOG.wait_for_the_end()  # It ends every host; the others may not join a vote.
    if self._agree(failure is None):
      return
    watchdog.WATCHDOG.wait_for_the_end()  # Another host's verdict may be on its way.
    raise self._write_failed(failure)

  def _report(self, step: int, error: BaseException) -> None:
    """A write of `step` failed on this host (any thread): the watchdog ends every host now."""
    if step in self._reported:
      return
    last_good, size = self._last_good(committed_steps(self.directory), step)
    text = write_failed.message(self.directory, step, error, size, last_good)
    if watchdog.WATCHDOG.fail(WRITE_FAILED_EXIT, f"host {jax.process_index()}: {text}"):
      self._reported.add(step)

  def _write_failed(self, failure: WriteError | None) -> CheckpointWriteFailed:
    """The one message of a failed write: folder, space, last good checkpoint, how to resume."""
    try:
      self._manager.wait_until_finished()  # An earlier save still committing counts as good.
    except Exception as e:  # pylint: disable=broad-except
      log.info("an earlier checkpoint write failed too: %s", e)
    complete = self.complete_steps()
    # orbax reports a background write's failure at the next save: name the
    # oldest step handed over that never completed, not the one being saved.
    tried = self._handed + ([failure.step] if failure is not None else [])
    failed = [s for s in tried if s not in complete]
    step = min(failed) if failed else (failure.step if failure is not None else self.last_saved)
    last_good, size = self._last_good(complete, step)
    size = size or (failure.nbytes if failure is not None else None)
    text = write_failed.message(self.directory, step, None if failure is None else failure.cause,
                                size, last_good)
    return CheckpointWriteFailed(text, step, self.directory)

  def _last_good(self, complete: list[int], step: int | None) -> tuple[int | None, int | None]:
    """The newest complete step before `step` (None: any), and its folder's bytes."""
    last = next((s for s in complete if step is None or s < step), None)
    folder = None if last is None else os.path.join(self.directory, str(last))
    return last, None if folder is None else write_failed.folder_bytes(folder)

  def wait(self) -> None:
    """Blocks until every started save is complete on disk (`CheckpointWriteFailed` as `save`)."""
    failure = self._finished_hand_over()
    if failure is None:
      try:
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        failure = WriteError(self.last_saved, e, 0)
    self._raise_if_any_failed(failure)

  def close(self) -> None:
    try:
      self._finished_hand_over()
    finally:
      self._worker.shutdown()
      try:
        self._manager.close()
      except Exception as e:  # pylint: disable=broad-except
        log.debug("closing the checkpoint manager after a failed write: %s", e)

  def complete_steps(self) -> list[int]:
    """Steps whose folders orbax committed, newest first."""
    self._manager.reload()
    steps = sorted(self._manager.all_steps(), reverse=True)
    return [s for s in steps if (self._path / str(s) / _COMMIT_MARKER).exists()]

  def restore_latest(self, like: Any, job: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """`(state, meta)` of the newest checkpoint that loads on every host, restored onto `like`'s
    shardings (a fresh `TrainState` on this job's mesh: another host count is fine); None when
    the folder holds none. A checkpoint of another `job` (`describe_job`) is refused with a
    ValueError saying what differs."""
    all_steps = sorted(self._manager.all_steps(), reverse=True)
    complete = self.complete_steps()
    for step in all_steps:
      if step not in complete:
        self._set_aside(step, "was never completed (no commit marker; a save was interrupted)")
    for step in complete:
      meta = self._read_meta(step)
      ok = self._agree(meta is not None)
      if not ok:
        self._set_aside(step, "has missing or damaged metadata")
        continue
      differences = job_differences(meta["job"], job)
      if differences:
        raise ValueError(f"checkpoint {self.directory}/{step} belongs to another job: "
                         + "; ".join(differences) + ". Use another checkpoint folder (`ckpt_dir`), "
                         "or start afresh without resuming (`resume`; its checkpoints are then "
                         "replaced).")
      state, missing = self._read_state(step, like)
      if not self._agree(state is not None):
        self._set_aside(step, "has damaged or incomplete arrays")
        continue
      if missing:
        _say(f"checkpoint {self.directory}/{step} predates {', '.join(missing)}; "
             + "; ".join(_describe_fill(name, state[name]) for name in missing) + ".")
      self.last_saved = step  # Already on disk: a run with nothing left to do must not resave it.
      return type(like)(**state), meta
    return None

  def _set_aside(self, step: int, why: str) -> None:
    """Renames a step folder that cannot be loaded to STEP.damaged, so this run saves it anew.
    Host 0 renames (the folder is shared); the vote after it is the others' barrier."""
    source = self._path / str(step)
    target = self._path / f"{step}{DAMAGED_SUFFIX}"
    n = 1
    while target.exists():
      n += 1
      target = self._path / f"{step}{DAMAGED_SUFFIX}-{n}"
    moved = None
    if jax.process_index() == 0:
      try:
        source.rename(target)
        moved = target
      except OSError as e:
        log.info("could not rename %s: %s", source, e)
    self._agree(True)  # Every host waits here for the rename.
    self._manager.reload()
    where = f"moved to {moved.name} for inspection" if moved else "left in place"
    _say(f"checkpoint {self.directory}/{step} {why}: skipped ({where}); trying the previous one.",
         warning=True)

  def _read_meta(self, step: int) -> dict[str, Any] | None:
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      log.debug("metadata of step %d unreadable: %s", step, e)
      return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "job" not in meta:
      return None
    return meta

  def _read_state(self, step: int, like: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """The arrays of `step` on `like`'s shardings, and the `ADDED_FIELDS` it lacked (taken
    from `like`, so an older checkpoint continues the run); any other difference is damage."""
    fresh = like._asdict()
    try:
      saved = set(self._manager.item_metadata(step).state.keys())
    except Exception as e:  # pylint: disable=broad-except
      log.debug("array metadata of step %d unreadable: %s", step, e)
      return None, []
    missing = [name for name in ADDED_FIELDS if name in fresh and name not in saved]
    wanted = {k: v for k, v in fresh.items() if k not in missing}
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), wanted)
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))).state
    except Exception as e:  # pylint: disable=broad-except
      log.debug("arrays of step %d unreadable: %s", step, e)
      return None, []
    # Restored containers may be plain tuples; the arrays go back into our structure.
    leaves, treedef = jax.tree.leaves(restored), jax.tree.structure(wanted)
    if len(leaves) != treedef.num_leaves:
      return None, []
    state = jax.tree.unflatten(treedef, leaves)
    return {k: state[k] if k in state else fresh[k] for k in fresh}, missing


def committed_steps(directory: str) -> list[int]:
  """Steps whose folders hold orbax's commit marker, newest first (a plain listing: any thread)."""
  path = epath.Path(directory)
  try:
    names = [p.name for p in path.iterdir()]
  except OSError:
    return []
  return sorted((int(n) for n in names if n.isdigit() and (path / n / _COMMIT_MARKER).exists()),
                reverse=True)


def _describe_fill(name: str, value: Any) -> str:
  """How a field missing from an older checkpoint was filled, for the one printed line."""
  if name == "loss_scale":
    scale = float(np.asarray(value.scale.addressable_data(0)))
    return f"loss scale set to {scale:g}, the default for this run's precision"
  return f"{name} set to this run's initial value"


def _nbytes(state: Any) -> int:
  return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)))


def _say(message: str, warning: bool = False) -> None:
  """One line on host 0 (a warning on stderr), and the log at INFO, so an unconfigured log adds
  no copy."""
  if jax.process_index() == 0:
    print(f"hetjax: {'warning: ' if warning else ''}{message}",
          file=sys.stderr if warning else sys.stdout, flush=True)
  log.info(message)

