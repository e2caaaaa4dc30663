"""Where a job's wall time went: goodput, and badput by cause, over every restart.

Pure arithmetic (no JAX) on OUT/phases/host<i>.jsonl (`goodput_record`). A
host's wall time, from its first process's start to its last line, splits
without remainder into:
- `compute`: its devices' own compute in steps that were kept (the goodput);
- `startup` (before the first phase), then each phase's own time (an inner
  phase's time is its own, not its parent's);
- the training phase's steps, each split into `compute`, `waiting for
  input` (the devices idle while the loader had not yet handed over the
  step's batch: a host short of CPU), `dispatch` (the rest of the step
  outside its compute and wait: the host dispatching the programs),
  `waiting for other hosts` (its wait less the reduction) and `reduction`
  (the fastest host's wait: the collective itself); the first steps' time
  beyond a typical step is `compiling`;
- `progress lost`: steps redone after a restart (numbered after the step the
  next attempt resumed from), with the time they took in the earlier attempt;
- `disruption`: the tail of a training phase that failed or never ended
  after its last recorded step (the fault's own time, and its detection);
- `restart wait`: from one attempt's last line to the next process's start;
- `step loop overhead`: the training phase's time between the steps;
- `untracked`: time inside an attempt outside every phase.

The job's figures are the hosts' means; goodput is `compute` over the wall time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from typing import Any, Iterable, Sequence

from hetjax import phases as phases_lib

COMPUTE = "compute"
STARTUP, COMPILING, INPUT, DISPATCH = "startup", "compiling", "waiting for input", "dispatch"
WAITING, REDUCTION = "waiting for other hosts", "reduction"
LOST, DISRUPTION, RESTART_WAIT = "progress lost", "disruption", "restart wait"
OVERHEAD, UNTRACKED = "step loop overhead", "untracked"
# Every cause of badput, in the order a reader meets them in a job's life.
CAUSES = (STARTUP, phases_lib.JOINING, phases_lib.BUILDING, phases_lib.RESTORING, COMPILING, INPUT,
          DISPATCH, WAITING, REDUCTION, phases_lib.EVALUATION, phases_lib.CHECKPOINT,
          phases_lib.AGREEMENT, phases_lib.SUMMARY, LOST, DISRUPTION, RESTART_WAIT, OVERHEAD, UNTRACKED)
WARMUP_STEPS = 2  # As hetjax.modes.sync.WARMUP_STEPS (this module loads without JAX).


@dataclasses.dataclass
class Interval:
  """One phase of one attempt; `open`: it never ended (the process died inside it)."""

  phase: str
  start: float
  end: float | None = None
  step: int | None = None
  parent: int | None = None   # index of the enclosing interval in its attempt
  failed: bool = False
  open: bool = False

  @property
  def seconds(self) -> float:
    return max(0.0, (self.end or self.start) - self.start)


@dataclasses.dataclass
class Step:
  """One step as this host lived it (a `hetjax.observe.metrics` record, its column)."""

  step: int                   # steps done, counting this one
  at: float                   # wall clock when the record reached the recorder
  step_s: float
  compute_s: float
  wait_s: float
  reduction_s: float          # the fastest host's wait that step
  flops: float | None = None  # this host's compiled programs' FLOPs for its share
  input_s: float = 0.0        # of compute_s: the devices idle, waiting for the loader


@dataclasses.dataclass
class Attempt:
  """One process's life on one host."""

  number: int
  process_start: float
  end: float
  intervals: list[Interval] = dataclasses.field(default_factory=list)
  steps: list[Step] = dataclasses.field(default_factory=list)
  device: dict[str, Any] = dataclasses.field(default_factory=dict)
  closed: bool = False        # it ended through the recorder's close (not killed)
  restart_count: int = 0      # the launcher's HETJAX_RESTART_COUNT

  @property
  def fresh(self) -> bool:
    """Whether it began a job: started by hand (no restart count), from step 0 or before any."""
    return self.restart_count == 0 and self.start_step in (None, 0)

  @property
  def start_step(self) -> int | None:
    """The step it started from (0, or the checkpoint's it resumed); None without steps."""
    return min(s.step for s in self.steps) - 1 if self.steps else None


@dataclasses.dataclass
class HostTime:
  """One host's wall time by cause, and its achieved FLOP/s."""

  host: int
  wall_s: float
  seconds: dict[str, float]   # COMPUTE and every cause in CAUSES
  attempts: int
  redone_steps: int
  steps_run: int              # steps recorded over every attempt (redone ones twice)
  flops_per_s: float | None = None   # over its compute seconds after warm-up
  device_kind: str | None = None
  devices: int = 1
  precision: str = "fp32"
  emulated: bool = False

  @property
  def goodput(self) -> float:
    return self.seconds[COMPUTE] / self.wall_s if self.wall_s > 0 else 0.0


def read_lines(path: str) -> list[dict[str, Any]]:
  """The lines of one host's file; a torn last line (a killed process's) is dropped."""
  with open(path) as f:
    text = f.read().split("\n")
  lines = []
  for number, line in enumerate(text, 1):
    if not line.strip():
      continue
    try:
      lines.append(json.loads(line))
    except json.JSONDecodeError:
      if number >= len(text) - 1:
        break
      raise ValueError(f"{path}, line {number} is not JSON; the phase records are written by "
                       "hetjax.observe.goodput_record (is the file hand-edited?).") from None
  return lines


def attempts_of(lines: Iterable[dict[str, Any]]) -> list[Attempt]:
  """Groups a host's lines into attempts, pairing each phase's start and end."""
  out: list[Attempt] = []
  stack: list[int] = []
  for line in lines:
    kind = line["kind"]
    if kind == "attempt":
      if out and out[-1].number == line["attempt"]:
        continue  # Another fit() of the same process: the same attempt goes on.
      _close_open(out[-1] if out else None, stack)
      out.append(Attempt(line["attempt"], line["process_start"], line["at"],
                         restart_count=int(line.get("restart_count") or 0)))
      stack = []
      continue
    if not out:
      raise ValueError("a phase record before its attempt line; each attempt starts with one.")
    a = out[-1]
    a.end = max(a.end, line.get("at", a.end))
    if kind == "start":
      a.intervals.append(Interval(line["phase"], line["at"], step=line.get("step"),
                                  parent=stack[-1] if stack else None))
      stack.append(len(a.intervals) - 1)
    elif kind == "end":
      while stack:  # An end closes its own start (and any inner one left open).
        iv = a.intervals[stack.pop()]
        iv.end = line["at"]
        if iv.phase == line["phase"]:
          iv.failed = bool(line.get("failed"))
          break
        iv.open = True
    elif kind == "step":
      a.steps.append(Step(line["step"], line["at"], line["step_s"], line["compute_s"],
                          line["wait_s"], line["reduction_s"], line.get("flops"),
                          line.get("input_s") or 0.0))
    elif kind == "device":
      a.device = {k: v for k, v in line.items() if k not in ("kind", "at")}
    elif kind == "close":
      a.closed = True
  _close_open(out[-1] if out else None, stack)
  return out


def _close_open(attempt: Attempt | None, stack: list[int]) -> None:
  """Phases a dead process never left end at its last line."""
  for index in stack:
    iv = attempt.intervals[index]
    iv.end, iv.open = attempt.end, True


def job_attempts(attempts: Sequence[Attempt]) -> list[Attempt]:
  """The attempts of the newest job in a file: from its last fresh attempt on."""
  starts = [i for i, a in enumerate(attempts) if a.fresh]
  return list(attempts[starts[-1] if starts else 0:])


def host_time(attempts: Sequence[Attempt], host: int = 0, warmup: int = WARMUP_STEPS) -> HostTime:
  """One host's wall time by cause (see the module docstring), over its job's attempts."""
  attempts = job_attempts(attempts)
  if not attempts:
    raise ValueError(f"host {host} recorded no attempt; was the run started with --out?")
  seconds = dict.fromkeys((COMPUTE,) + CAUSES, 0.0)
  redone = 0
  for i, a in enumerate(attempts):
    later = [b.start_step for b in attempts[i + 1:] if b.start_step is not None]
    redo_after = min(later) if later else math.inf
    redone += sum(s.step > redo_after for s in a.steps)
    _attempt_time(a, redo_after, warmup, seconds)
    if i:
      seconds[RESTART_WAIT] += max(0.0, a.process_start - attempts[i - 1].end)
  device = next((a.device for a in reversed(attempts) if a.device), {})
  steady = [s for a in attempts for s in a.steps[warmup:]]
  flops = sum(s.flops or 0.0 for s in steady)
  compute = sum(s.compute_s for s in steady)
  known = steady and all(s.flops is not None for s in steady) and compute > 0
  return HostTime(host, attempts[-1].end - attempts[0].process_start, seconds, len(attempts),
                  redone, sum(len(a.steps) for a in attempts), flops / compute if known else None,
                  device.get("device_kind"), int(device.get("devices", 1)),
                  device.get("precision", "fp32"), bool(device.get("emulated", False)))


def _attempt_time(a: Attempt, redo_after: float, warmup: int, seconds: dict[str, float]) -> None:
  """Adds one attempt's seconds by cause into `seconds`."""
  top = [iv for iv in a.intervals if iv.parent is None]
  first = min((iv.start for iv in top), default=a.end)
  seconds[STARTUP] += max(0.0, first - a.process_start)
  seconds[UNTRACKED] += max(0.0, (a.end - first) - sum(iv.seconds for iv in top))
  inner = [0.0] * len(a.intervals)
  for iv in a.intervals:
    if iv.parent is not None:
      inner[iv.parent] += iv.seconds
  training, tail = 0.0, 0.0
  for iv, nested in zip(a.intervals, inner):
    own = max(0.0, iv.seconds - nested)
    if iv.phase != phases_lib.TRAINING:
      seconds[iv.phase] += own
      continue
    training += own
    if iv.failed or iv.open:  # After its last recorded step: the fault and its detection.
      last = max([s.at for s in a.steps if s.at <= iv.end] + [iv.start])
      tail += min(own, max(0.0, iv.end - last))
  seconds[DISRUPTION] += tail
  _steps_time(a.steps, training - tail, redo_after, warmup, seconds)


def _steps_time(steps: Sequence[Step], available: float, redo_after: float, warmup: int,
                seconds: dict[str, float]) -> None:
  """Splits the training phase's `available` seconds over its steps, the rest as overhead
  (overlapping steps may sum to more than the phase: then they are scaled to fit)."""
  total = sum(s.step_s for s in steps)
  scale = available / total if total > available > 0 else (0.0 if available <= 0 else 1.0)
  seconds[OVERHEAD] += max(0.0, available - total * scale)
  kept = [s.step_s for k, s in enumerate(steps) if k >= warmup and s.step <= redo_after]
  typical = statistics.median(kept) if kept else min((s.step_s for s in steps), default=0.0)
  for k, s in enumerate(steps):
    wall = s.step_s * scale
    if s.step > redo_after:
      seconds[LOST] += wall
      continue
    parts = s.compute_s + s.wait_s
    fit = min(1.0, s.step_s / parts) * scale if parts > 0 else 0.0
    compute, wait = s.compute_s * fit, s.wait_s * fit
    starved = min(s.input_s * fit, compute)  # The balancer's compute counts it; goodput does not.
    reduction = min(s.reduction_s * fit, wait)
    kept_share = 1.0
    if k < warmup and wall > 0:
      excess = max(0.0, wall - typical * scale)
      seconds[COMPILING] += excess
      kept_share = (wall - excess) / wall
    seconds[COMPUTE] += (compute - starved) * kept_share
    seconds[INPUT] += starved * kept_share
    seconds[REDUCTION] += reduction * kept_share
    seconds[WAITING] += (wait - reduction) * kept_share
    seconds[DISPATCH] += max(0.0, wall - compute - wait) * kept_share


@dataclasses.dataclass
class JobTime:
  """The job's wall time by cause: the means over its hosts."""

  wall_s: float
  seconds: dict[str, float]
  hosts: list[HostTime]
  emulated: bool

  @property
  def goodput(self) -> float:
    return self.seconds[COMPUTE] / self.wall_s if self.wall_s > 0 else 0.0

  @property
  def badput(self) -> dict[str, float]:
    """Seconds by cause, largest first, the causes that took none left out."""
    shown = {c: self.seconds[c] for c in CAUSES if self.seconds[c] > 0}
    return dict(sorted(shown.items(), key=lambda kv: -kv[1]))

  @property
  def recorded_s(self) -> float:
    """The wall time the records account for (all but `untracked`)."""
    return self.wall_s - self.seconds[UNTRACKED]


def job_time(hosts: Sequence[HostTime]) -> JobTime:
  """The hosts' means (each host's seconds add up to its own wall time, so the means do too)."""
  if not hosts:
    raise ValueError("no host recorded its phases; was the run started with --out?")
  n = len(hosts)
  seconds = {c: sum(h.seconds[c] for h in hosts) / n for c in hosts[0].seconds}
  return JobTime(sum(h.wall_s for h in hosts) / n, seconds, list(hosts),
                 any(h.emulated for h in hosts))


def read_job(out_dir: str) -> JobTime | None:
  """The job's time from its run folder's phase records (OUT/phases/host<i>.jsonl); None where
  it has none."""
  folder = os.path.join(out_dir, "phases")
  names = [n for n in (os.listdir(folder) if os.path.isdir(folder) else [])
           if n.startswith("host") and n.endswith(".jsonl")]
  paths = [os.path.join(folder, n) for n in sorted(names, key=lambda n: int(n[4:-6]))]
  if not paths:
    return None
  return job_time([host_time(attempts_of(read_lines(p)), int(os.path.basename(p)[4:-6]))
                   for p in paths])
