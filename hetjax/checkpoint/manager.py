"""Checkpoints of the whole train state with orbax (docs/design.md invariant 5).

A checkpoint is one orbax step folder with two items:
- `state`: the `TrainState` (step, parameters, optimizer state, model state)
  as global replicated arrays, which orbax saves once for the whole job and
  can restore onto another mesh (another number of hosts or devices);
- `meta`: JSON with what the arrays do not say: the job description (to
  refuse a checkpoint of another model or optimizer), the data cursor, the
  balancer state and the host layout that wrote it.

The RNG needs no entry of its own: every step's key is the seed's key folded
with the step (and micro-batch), so (seed, step) is the whole RNG state.

Every host calls every method here in the same order with the same
arguments (orbax's multi-host contract); which checkpoint to load is agreed
through a collective, so no host loads one the others skip.

An asynchronous save stalls the loop only for a snapshot:
`save_in_background` takes one replica of the state per host
(`hetjax.checkpoint.snapshot`: numpy views of the buffers on CPU, which JAX then does
not donate; elsewhere one asynchronous copy into pinned host memory), and a
worker thread hands it to orbax (per-array bookkeeping and thread start-up,
which grow with the number of arrays), then orbax
writes in its own background threads. The worker may run beside the
training collectives because every orbax barrier goes through the coordination service's
key-value store (`active_processes` = every host), never through a device
collective: orbax's default barrier (`sync_global_devices`) is an
all-gather over every device, which, issued from a second thread, meets the
training programs in different orders on different hosts (tried: gloo
aborts with "collective mismatch"). The hosts' workers run the same saves in
the same order (the main threads decide them at the same step), so their
barriers match.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shlex
import shutil
import sys
import time
from typing import Any, Callable

import jax
from jax.sharding import Mesh
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from hetjax.checkpoint import snapshot as snapshot_lib
from hetjax.cluster import signals
from hetjax.config import CheckpointConfig, is_remote, resolve  # noqa: F401 (public names)

PyTree = Any
FORMAT = 1
# TrainState fields a checkpoint may lack because it predates them: each is
# filled from the fresh state of this run (for `loss_scale`, the default
# scale of the run's precision: 1 in fp32/bf16, 2^15 in fp16).
ADDED_FIELDS = ("loss_scale",)
_COMMIT_MARKER = "commit_success.txt"  # Written by orbax when a step folder is complete.
DAMAGED_SUFFIX = ".damaged"  # A skipped step folder is renamed STEP.damaged, kept for inspection.
# A checkpoint that cannot be written stops every host with this exit code
# (EX_IOERR from sysexits.h: an input/output error, not a usage error (2)).
WRITE_FAILED_EXIT = 74
log = logging.getLogger("hetjax.checkpoint")


class CheckpointWriteFailed(signals.Stopped):
  """A checkpoint could not be written; every host stops with one message.

  The message names the folder, the free space against a checkpoint's
  size, the last good checkpoint (left intact) and the command that
  resumes; the command line exits with `WRITE_FAILED_EXIT`.
  """

  exit_code = WRITE_FAILED_EXIT

  def __init__(self, message: str, step: int | None = None, directory: str | None = None):
    self.step, self.directory, self.during = step, directory, None
    RuntimeError.__init__(self, message)  # pylint: disable=non-parent-init-called


class _WriteError(Exception):
  """A save that failed on the worker thread: its step and orbax's error, described later."""

  def __init__(self, step: int, cause: BaseException, nbytes: int):
    super().__init__(str(cause))
    self.step, self.cause, self.nbytes = step, cause, nbytes


class _QuietOrbax(logging.Filter):
  """Drops orbax's own tracebacks of a failed read or write: hetjax reports those itself.

  A damaged checkpoint that is skipped, or a write that fails, is said once
  in one line (or one message) by this module; orbax would add a traceback
  per background thread (`logging.exception`) for the same event.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
    return not (from_orbax and record.exc_info and record.levelno >= logging.WARNING)


_QUIET = _QuietOrbax()


def _from_a_closed_loop(kind: type, error: BaseException, tb: Any) -> bool:
  """A tensorstore callback that woke an asyncio loop orbax had already closed.

  After a failed read or write, tensorstore's completion callbacks still
  call `loop.call_soon_threadsafe` on the event loop of an orbax operation
  that has ended; the RuntimeError has no Python caller, so the interpreter
  prints it through `sys.excepthook`, once per pending array. Nothing is
  lost: the failure itself is reported by this module. Recognised by its
  traceback starting inside asyncio (no user frame), so no other error is
  hidden.
  """
  if kind is not RuntimeError or str(error) != "Event loop is closed" or tb is None:
    return False
  return os.path.basename(tb.tb_frame.f_code.co_filename) == "base_events.py"


def _install_quiet_hook() -> None:
  previous = sys.excepthook
  if getattr(previous, "_hetjax_quiet", False):
    return

  def hook(kind, error, tb):
    if _from_a_closed_loop(kind, error, tb):
      log.debug("dropped a callback on a closed event loop after a failed checkpoint read/write")
      return
    previous(kind, error, tb)

  hook._hetjax_quiet = True  # type: ignore[attr-defined]
  sys.excepthook = hook


def describe_job(state: Any, job: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint must match to be continued: shapes, optimizer, settings."""
  def shapes(tree: PyTree) -> dict[str, str]:
    return {jax.tree_util.keystr(path): f"{tuple(x.shape)} {x.dtype}"
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}

  return {"params": shapes(state.params), "model_state": shapes(state.model_state),
          "optimizer": str(jax.tree.structure(state.opt_state)), **job}


def job_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """Human lines naming what differs between two `describe_job` results."""
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key), current.get(key)
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
      shown = ", ".join(f"{n}: saved {a.get(n, 'absent')}, now {b.get(n, 'absent')}"
                        for n in names[:3])
      more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
      out.append(f"{key} differ ({len(names)} entries): {shown}{more}")
    elif key == "optimizer":
      out.append("optimizer state has another structure (another optimizer or schedule)")
    else:
      out.append(f"{key}: saved {a!r}, now {b!r}")
  return out


class Checkpointer:
  """An orbax `CheckpointManager` for hetjax train states.

  Args:
    config: folder, interval, how many to keep.
    agree: `agree(flag) -> bool`, True when every host's flag is True (a
      collective); decides together whether a checkpoint loaded everywhere.
  """

  def __init__(self, config: CheckpointConfig, agree: Callable[[bool], bool]):
    config.validate()
    self.config = config
    self.directory = resolve(config.directory)
    self._path = epath.Path(self.directory)
    self._agree = agree
    # Barriers through the key-value store (see the module docstring). Orbax
    # then leaves the root folder to us: `validate` made it (a URL needs none).
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.keep, create=False, enable_async_checkpointing=config.async_save,
        multiprocessing_options=ocp.options.MultiprocessingOptions(
            active_processes=set(range(jax.process_count()))))
    # Handlers named up front so `item_metadata` can tell which fields a
    # checkpoint holds before its arrays are read (an older one lacks some).
    for name in ("absl", ""):  # orbax logs through absl's logger (the root one without absl).
      if _QUIET not in logging.getLogger(name).filters:
        logging.getLogger(name).addFilter(_QUIET)
    _install_quiet_hook()
    self._manager = ocp.CheckpointManager(
        self._path, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})
    self.last_saved: int | None = None
    self._handed: list[int] = []  # Steps handed to orbax; a background write may fail later.
    self._snapshots = snapshot_lib.SnapshotTaker()
    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hetjax-ckpt")
    self._handing_over: concurrent.futures.Future | None = None
    self.snapshot_s: list[float] = []  # Seconds each snapshot blocked the caller.
    self.handover_s: list[float] = []  # Seconds each hand-over spent in orbax (on the worker).

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Hands the state after `step` steps to orbax on this thread (written in the
    background if async); `state` must not be donated until this returns.

    Raises:
      CheckpointWriteFailed: on every host, when a save failed on any host.
    """
    failure = self._finished_hand_over()
    if failure is None and step != self.last_saved:
      try:
        self._hand_over(step, state, meta)
        self.last_saved = step
      except _WriteError as e:
        failure = e
    self._raise_if_any_failed(failure)

  def save_in_background(self, step: int, state: Any, meta: dict[str, Any],
                         hosts: Mesh | None = None) -> None:
    """Saves the state after `step` steps, blocking only for a snapshot of it.

    The snapshot (`hetjax.checkpoint.snapshot`) is the worker's to hand to orbax, so
    the caller may donate `state` at once. `state` may be replicated over
    this host's devices only, with `hosts` a mesh over every host's. Waits
    first for the previous hand-over (it takes a fraction of a step; saves
    are many steps apart).
    """
    self._raise_if_any_failed(self._finished_hand_over())
    if step == self.last_saved:
      return
    t0 = time.perf_counter()
    snapshot = self._snapshots.take(state, hosts)
    self.snapshot_s.append(time.perf_counter() - t0)
    self.last_saved = step
    self._handing_over = self._worker.submit(
        lambda: self._hand_over(step, snapshot.as_global(), meta))

  def _hand_over(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """orbax's save; its error (this one, or an earlier background write's) as a `_WriteError`."""
    t0 = time.perf_counter()
    meta = {"format": FORMAT, "step": step, **meta}
    try:
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state._asdict()), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except
      raise _WriteError(step, e, _nbytes(state)) from e
    self._handed.append(step)
    self.handover_s.append(time.perf_counter() - t0)

  def _finished_hand_over(self) -> _WriteError | None:
    """Waits for the worker's hand-over; its failure, if any (other errors re-raised)."""
    handing_over, self._handing_over = self._handing_over, None
    if handing_over is None:
      return None
    try:
      handing_over.result()
    except _WriteError as e:
      return e
    return None

  def _raise_if_any_failed(self, failure: _WriteError | None) -> None:
    """Every host stops together when a write failed on any of them (a collective)."""
    if self._agree(failure is None):
      return
    raise self._write_failed(failure)

  def _write_failed(self, failure: _WriteError | None) -> CheckpointWriteFailed:
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
    good = [s for s in complete if step is None or s < step]
    last_good = good[0] if good else None
    size = _folder_bytes(self._path / str(last_good)) if last_good is not None else None
    size = size or (failure.nbytes if failure is not None else None)
    cause = "it failed on another host" if failure is None else _first_line(failure.cause)
    text = (f"cannot write checkpoint {self.directory}/{step}: {cause}. "
            f"Free space there: {_free_space(self.directory)}; a checkpoint takes about "
            f"{_megabytes(size)}. ")
    if last_good is None:
      text += "No earlier checkpoint is complete; the run must start afresh. "
    else:
      text += f"The last good checkpoint, {self.directory}/{last_good}, is intact. "
    partial = _partial_folders(self.directory)
    if partial:
      text += f"The unfinished {', '.join(partial)} there may be deleted. "
    text += (f"Free space (or point --ckpt-dir at a larger disk, copying that checkpoint "
             f"along), then resume with: {_resume_command()}  (exit code {WRITE_FAILED_EXIT})")
    return CheckpointWriteFailed(text, step, self.directory)

  def wait(self) -> None:
    """Blocks until every started save is complete on disk.

    Raises:
      CheckpointWriteFailed: on every host, when a save failed on any host.
    """
    failure = self._finished_hand_over()
    if failure is None:
      try:
        self._manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        failure = _WriteError(self.last_saved, e, 0)
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
    """The newest checkpoint that loads on every host, restored onto `like`'s shardings.

    Args:
      like: a freshly initialised `TrainState` on this job's mesh (its
        shardings decide where the restored arrays go: another host count is
        fine).
      job: `describe_job(...)` of this run; a checkpoint of another job is
        refused with a `ValueError` saying what differs.

    Returns:
      `(state, meta)`, or None when the folder holds no usable checkpoint.
    """
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
                         + "; ".join(differences) + ". Use another --ckpt-dir, or "
                         "--no-resume to start afresh (its checkpoints are then replaced).")
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
    """Renames a step folder that cannot be loaded to STEP.damaged, so this run saves that step anew.

    Host 0 renames (the folder is shared); the vote after it is the barrier
    that keeps the other hosts from listing the folder before it moved. One
    line on host 0 says so.
    """
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
    _warn(f"checkpoint {self.directory}/{step} {why}: skipped ({where}); trying the previous one.")

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
    """The arrays of `step` on `like`'s shardings, and the `ADDED_FIELDS` it lacked.

    A field in `ADDED_FIELDS` that the checkpoint does not hold is taken from
    `like` (the run's fresh state), so a checkpoint written before the field
    existed still continues the run; any other difference is damage (None).
    """
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
    leaves = jax.tree.leaves(restored)
    treedef = jax.tree.structure(wanted)
    if len(leaves) != treedef.num_leaves:
      return None, []
    state = jax.tree.unflatten(treedef, leaves)
    return {k: state[k] if k in state else fresh[k] for k in fresh}, missing


def _describe_fill(name: str, value: Any) -> str:
  """How a field missing from an older checkpoint was filled, for the one printed line."""
  if name == "loss_scale":
    scale = float(np.asarray(value.scale.addressable_data(0)))
    return f"loss scale set to {scale:g}, the default for this run's precision"
  return f"{name} set to this run's initial value"


def _nbytes(state: Any) -> int:
  return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state)))


def _folder_bytes(path: epath.Path) -> int | None:
  """Bytes under a local step folder (None for a URL or an unreadable folder)."""
  if is_remote(str(path)):
    return None
  total = 0
  for root, _, files in os.walk(str(path)):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total or None


def _partial_folders(directory: str) -> list[str]:
  """orbax's unfinished step folders (STEP.orbax-checkpoint-tmp...) in a local folder."""
  if is_remote(directory):
    return []
  try:
    return sorted(n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n)
  except OSError:
    return []


def _megabytes(n: int | None) -> str:
  if not n:
    return "an unknown size"
  return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _free_space(directory: str) -> str:
  if is_remote(directory):
    return "unknown (a URL)"
  try:
    return f"{shutil.disk_usage(directory).free / 1e6:.1f} MB"
  except OSError:
    return "unknown"


def _first_line(error: BaseException) -> str:
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def _resume_command() -> str:
  """This process's command, as a user would type it again (it resumes from the newest)."""
  argv = list(sys.argv)
  if not argv or argv[0] == "-c":
    return "the same command again"
  if os.path.basename(argv[0]) == "hetjax":
    argv[0] = "hetjax"
  elif argv and argv[0].endswith(".py"):
    argv = ["python"] + argv
  return shlex.join(argv) if argv else "the same command"


def _say(message: str) -> None:
  if jax.process_index() == 0:
    print(f"hetjax: {message}", flush=True)
  log.info(message)


def _warn(message: str) -> None:
  """One line on host 0's stderr (and the log at INFO, so an unconfigured log adds no copy)."""
  if jax.process_index() == 0:
    print(f"hetjax: warning: {message}", file=sys.stderr, flush=True)
  log.info(message)

