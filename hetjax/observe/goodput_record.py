"""Each host's phases and steps, written as they happen into OUT/phases/host<i>.jsonl.

Every line is flushed, so a host killed with SIGKILL leaves every phase and
step it recorded. Lines (`kind`): `attempt` (a process's start and pid),
`start` / `end` (a phase), `step` (this host's column of a record, its FLOPs),
`device`, `close` (a clean end).

A job's processes append to one file: a restarted host (HETJAX_RESTART_COUNT
> 0) or a process after one that did not close continues it; after a closed
one with no restart count the file starts afresh. A hand-started run from step
0 also begins a new job when read (`goodput.job_attempts`). `hetjax train --out`
records the whole process (`recording`); `Trainer.fit(out=...)` its call (`for_fit`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Callable, Iterator

from hetjax import phases as phases_lib

PHASES_DIR = "phases"

_ACTIVE: "Recorder | None" = None  # The process's recorder, while `recording` holds it.


def process_start_time() -> float:
  """When this process started (wall clock), from /proc; now where /proc is missing."""
  try:
    with open("/proc/self/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - (since_boot - started_after_boot)
  except (OSError, ValueError, IndexError, AttributeError):
    return time.time()


class Recorder:
  """One process's phase record (a `hetjax.phases.Listener`, and a records sink)."""

  def __init__(self, out: str, *, process_start: float | None = None,
               clock: Callable[[], float] = time.time):
    self.out, self._clock = out, clock
    self._lock = threading.Lock()
    self._file = None
    self.host: int | None = None
    self._device_written = False
    start = process_start_time() if process_start is None else process_start
    # Lines wait here until the host is known (after joining).
    self._buffer: list[dict[str, Any]] = [{"kind": "attempt", "process_start": start,
                                           "at": clock(), "pid": os.getpid(),
                                           "restart_count": _restart_count()}]
    self.attempt: int | None = None

  @property
  def path(self) -> str | None:
    return None if self.host is None else os.path.join(self.out, PHASES_DIR,
                                                       f"host{self.host}.jsonl")

  def bind(self, host: int) -> None:
    """Files the lines under `host` (once); the file opens when the run is underway."""
    with self._lock:
      if self.host is None:
        self.host = host
      self._open_if_underway_locked(None)

  def _open_if_underway_locked(self, line: dict[str, Any] | None) -> None:
    """Opens the file once the host is known and the run is underway: its folder exists, or
    a phase past building starts. A command refused while building leaves no folder."""
    if self._file is not None or self.host is None:
      return
    underway = os.path.isdir(self.out) or (
        line is not None and line.get("kind") != "attempt"
        and line.get("phase") not in (phases_lib.JOINING, phases_lib.BUILDING))
    if not underway:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    previous = _previous_attempts(self.path)
    restarted = _restart_count() > 0
    same_process = bool(previous) and previous[-1]["pid"] == os.getpid()  # Another fit().
    fresh = bool(previous) and previous[-1]["closed"] and not restarted and not same_process
    self.attempt = (previous[-1]["attempt"] if same_process
                    else 0 if fresh or not previous else previous[-1]["attempt"] + 1)
    self._file = open(self.path, "w" if fresh else "a")
    lines, self._buffer = self._buffer, []
    for buffered in lines:
      self._write_locked(buffered)

  def _write(self, line: dict[str, Any]) -> None:
    with self._lock:
      if self._file is None:
        self._buffer.append(line)
        self._open_if_underway_locked(line)
      else:
        self._write_locked(line)

  def _write_locked(self, line: dict[str, Any]) -> None:
    line.setdefault("attempt", self.attempt)
    self._file.write(json.dumps(line) + "\n")
    self._file.flush()

  def phase_started(self, name: str, step: int | None, at: float) -> None:
    self._write({"kind": "start", "phase": name, "step": step, "at": at})

  def phase_ended(self, name: str, step: int | None, at: float, failed: bool) -> None:
    self._write({"kind": "end", "phase": name, "step": step, "at": at, "failed": failed})

  def device(self, device_kind: str, devices: int, precision: str, emulated: bool) -> None:
    """What this host runs on (once per process): for the peak FLOP/s."""
    if not self._device_written:
      self._device_written = True
      self._write({"kind": "device", "device_kind": device_kind, "devices": devices,
                   "precision": precision, "emulated": emulated, "at": self._clock()})

  def step_sink(self, host: int, flops_of: Callable[[int], float | None] | None
                ) -> Callable[[dict[str, Any]], None]:
    """A records sink writing host `host`'s column of each record (and its share's FLOPs)."""
    def sink(record: dict[str, Any]) -> None:
      share = record["shares"][host]
      self._write({"kind": "step", "step": record["step"], "at": self._clock(),
                   "step_s": record["step_s"], "compute_s": record["compute_s"][host],
                   "wait_s": record["wait_s"][host], "reduction_s": min(record["wait_s"]),
                   "input_s": record.get("metrics", {}).get(f"input_s/{host}", 0.0),
                   "flops": None if flops_of is None else flops_of(share)})
    return sink

  def close(self, host: int | None = None) -> None:
    """Marks a clean end and closes the file (binding to `host` first if never bound).

    A process that never got underway (a command refused while building, in
    a folder no job has used) leaves nothing behind."""
    if self._file is None:
      self.bind(self.host if host is None else host)
      if self._file is None:
        return
    self._write({"kind": "close", "at": self._clock()})
    with self._lock:
      self._file.close()


def _restart_count() -> int:
  """Which restart of the job this process is (the launchers' HETJAX_RESTART_COUNT; 0 unset)."""
  return int(os.environ.get("HETJAX_RESTART_COUNT") or 0)


def _previous_attempts(path: str) -> list[dict[str, Any]]:
  """The attempts already in `path`: number, pid and whether each closed."""
  if not os.path.exists(path):
    return []
  out: list[dict[str, Any]] = []
  with open(path) as f:
    for line in f:
      try:
        line = json.loads(line)
      except json.JSONDecodeError:
        continue  # A torn line of a killed process.
      if line.get("kind") == "attempt" and not (out and out[-1]["attempt"] == line["attempt"]):
        out.append({"attempt": line["attempt"], "pid": line.get("pid"), "closed": False})
      elif line.get("kind") == "close" and out:
        out[-1]["closed"] = True
  return out


def active() -> Recorder | None:
  """The process's recorder while `recording` runs (None otherwise)."""
  return _ACTIVE


@contextlib.contextmanager
def recording(out: str | None, host_from_env: Callable[[], int]) -> Iterator[Recorder | None]:
  """Records this whole process's phases into `out` (nothing when `out` is None).

  `host_from_env`: the host id to file under when the process ends before
  `bind` (it failed before joining).
  """
  global _ACTIVE
  if out is None:
    yield None
    return
  recorder = Recorder(out)
  outer, _ACTIVE = _ACTIVE, recorder
  try:
    with phases_lib.PHASES.subscribe(recorder):
      yield recorder
    recorder.close(host_from_env())
  finally:
    _ACTIVE = outer
    if recorder._file is not None and not recorder._file.closed:
      recorder._file.close()  # A failed process: no close line (it did not end cleanly).


@contextlib.contextmanager
def for_fit(out: str | None, host: int) -> Iterator[Recorder | None]:
  """The recorder of one `fit(out=...)` call: the process's when it records into `out`,
  else one for this call alone."""
  if out is not None and _ACTIVE is not None and (
      os.path.abspath(_ACTIVE.out) == os.path.abspath(out)):
    _ACTIVE.bind(host)
    yield _ACTIVE
    return
  with recording(out, lambda: host) as recorder:
    if recorder is not None:
      recorder.bind(host)
    yield recorder
