"""Heterogeneity EMULATION: identical CPU hosts made to behave as unlike ones.

Never on the real path; the one place that emulates, so tests and benchmarks on one machine
show unlike hosts: speeds (HETJAX_SPEED: sleep after the real compute so it appears to take
`1 / s` as long; or HETJAX_DEVICE_SAMPLE_MS per sample), stragglers (HETJAX_SLOWDOWN), hosts
that compile differently (`parse_host_env`) and faults (HETJAX_FAULTS). The launcher and
`hetjax.testing.run_hosts` set these variables. Stdlib only (the launcher imports no JAX).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
import time
from typing import Callable, Mapping, Sequence

from hetjax.config import Env


def check_speed(speed: float, *, name: str = "speed") -> float:
  """Returns `speed` as a float if it lies in (0, 1]; raises ValueError otherwise."""
  speed = float(speed)
  if not 0.0 < speed <= 1.0:  # Also rejects NaN.
    raise ValueError(f"{name} must be in (0, 1] (relative to the fastest host, which has "
                     f"speed 1.0), got {speed!r}.")
  return speed


def check_speeds(speeds: Sequence[float], hosts: int) -> list[float]:
  """Validates one speed per host, the fastest exactly 1.0 (else `0.5,0.5` and `1,1` would
  describe one cluster twice)."""
  speeds = [float(s) for s in speeds]
  if len(speeds) != hosts:
    raise ValueError(f"--speeds gives {len(speeds)} speed(s) ({_join(speeds)}) but there are "
                     f"{hosts} hosts; give exactly one speed per host.")
  for i, s in enumerate(speeds):
    check_speed(s, name=f"speed of host {i}")
  if max(speeds) != 1.0:
    raise ValueError(f"the fastest host has speed 1.0, but the largest of --speeds "
                     f"({_join(speeds)}) is {max(speeds)!r}; divide every speed by it.")
  return speeds


def parse_speeds(text: str) -> list[float]:
  """Parses a comma-separated list such as `1,0.5,0.25` (no range checks)."""
  speeds = []
  for item in text.split(","):
    try:
      speeds.append(float(item))
    except ValueError:
      raise ValueError(f"--speeds must be comma-separated numbers such as 1,0.5,0.25; "
                       f"{item.strip()!r} in {text!r} is not a number.") from None
  return speeds


def speed_from_env(env: Mapping[str, str] = os.environ) -> float:
  """This host's emulated relative speed from HETJAX_SPEED (1.0 when unset)."""
  raw = env.get(Env.SPEED)
  if raw is None or not raw.strip():
    return 1.0
  try:
    value = float(raw)
  except ValueError:
    raise ValueError(f"{Env.SPEED}={raw!r} is not a number; set it to a speed in (0, 1] "
                     "or unset it.") from None
  return check_speed(value, name=Env.SPEED)


class Pacer:
  """Stretches a host's measured compute time to emulate a slower device (`speed` in (0, 1])."""

  def __init__(self, speed: float, *, sleep: Callable[[float], None] | None = None):
    self.speed = check_speed(speed)
    self._sleep = sleep or time.sleep

  def pace(self, compute_s: float, factor: float = 1.0) -> float:
    """Sleeps so `compute_s` of real compute appears to take `compute_s * factor / speed`
    (returned); `factor` >= 1 is a straggler's extra slowdown ("4x slower from step 100")."""
    if not compute_s >= 0.0:
      raise ValueError(f"compute_s must be >= 0 seconds, got {compute_s!r}.")
    if not factor >= 1.0:
      raise ValueError(f"factor must be >= 1 (a slowdown; emulation cannot speed a host up), "
                       f"got {factor!r}.")
    emulated_s = compute_s * factor / self.speed
    extra_s = emulated_s - compute_s
    if extra_s > 0.0:
      self._sleep(extra_s)
    return emulated_s


def _join(values: Sequence[float]) -> str:
  return ",".join(f"{v:g}" for v in values)


@dataclasses.dataclass(frozen=True)
class Slowdown:
  """Host `host` becomes `factor` times slower from step `step` on (emulated straggler)."""

  host: int
  factor: float
  step: int


def parse_slowdowns(text: str) -> list[Slowdown]:
  """Parses `HOST:FACTOR@STEP[,HOST:FACTOR@STEP...]`, e.g. `2:3@50`."""
  out = []
  for item in filter(None, (t.strip() for t in text.split(","))):
    try:
      host, rest = item.split(":")
      factor, step = rest.split("@")
      slowdown = Slowdown(int(host), float(factor), int(step))
    except ValueError:
      raise ValueError(f"--slowdown takes HOST:FACTOR@STEP items such as 2:3@50; got {item!r}.") from None
    if slowdown.host < 0 or slowdown.step < 0 or not slowdown.factor >= 1.0:
      raise ValueError(f"--slowdown {item!r}: host and step must be >= 0 and the factor >= 1.")
    out.append(slowdown)
  return out


def slowdown_factor(slowdowns: Sequence[Slowdown], host: int, step: int) -> float:
  """The combined extra slowdown of `host` at `step`."""
  return math.prod((s.factor for s in slowdowns if s.host == host and step >= s.step), start=1.0)


class DevicePacer:
  """Emulates a device that needs `sample_s / speed` seconds per sample."""

  def __init__(self, speed: float, sample_s: float, *, sleep: Callable[[float], None] | None = None):
    self.speed = check_speed(speed)
    if not sample_s > 0.0:
      raise ValueError(f"emulated seconds per sample must be > 0, got {sample_s!r}.")
    self.sample_s = sample_s
    self._sleep = sleep or time.sleep

  def pace(self, compute_s: float, samples: int, factor: float = 1.0) -> float:
    """Sleeps for the emulated device time; returns real + emulated seconds."""
    if not factor >= 1.0:
      raise ValueError(f"factor must be >= 1 (a slowdown), got {factor!r}.")
    device_s = samples * self.sample_s * factor / self.speed
    if device_s > 0.0:
      self._sleep(device_s)
    return compute_s + device_s


def sample_ms_from_env(env: Mapping[str, str] = os.environ, name: str = Env.DEVICE_SAMPLE_MS,
                       what: str = "per sample, on the fastest emulated device") -> float | None:
  """HETJAX_DEVICE_SAMPLE_MS (or `name`) as milliseconds, or None when unset."""
  raw = env.get(name, "").strip()
  if not raw:
    return None
  try:
    value = float(raw)
  except ValueError:
    value = float("nan")
  if not value > 0.0:
    raise ValueError(f"{name}={raw!r} must be a number of milliseconds > 0 ({what}), or unset.")
  return value


class PacedInput:
  """EMULATED input: a host short of CPU, whose reader sleeps `sample_s` per record (in the
  loader's thread or worker, so reads ahead overlap the step as real decoding does)."""

  def __init__(self, source, sample_s: float, *, sleep: Callable[[float], None] = time.sleep):
    self.source, self.sample_s, self._sleep = source, sample_s, sleep
    self.info = source.info

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, indices):
    self._sleep(self.sample_s * len(indices))
    return self.source[indices]

  def __getattr__(self, name: str):
    if name != "train_records" or "source" not in self.__dict__:
      raise AttributeError(name)
    train_records = self.source.train_records  # Decoded images' training view, paced too.

    def paced(indices, keys):
      self._sleep(self.sample_s * len(indices))
      return train_records(indices, keys)
    return paced


def paced_input_from_env(source, env: Mapping[str, str] = os.environ):
  """`source`, slowed by HETJAX_INPUT_SAMPLE_MS where this host has it (emulation only)."""
  ms = sample_ms_from_env(env, Env.INPUT_SAMPLE_MS, "input time per record on this host")
  return source if ms is None else PacedInput(source, ms / 1e3)


Pace = Callable[..., float]


def pacing_from_env(host: int, env: Mapping[str, str] = os.environ) -> Pace | None:
  """The pacing hook `(compute_s, step, samples=0) -> emulated_s` for this host (None: nothing
  emulated): compute stretched by `1 / speed`, or device time per sample added
  (`Env.DEVICE_SAMPLE_MS`)."""
  speed = speed_from_env(env)
  sample_ms = sample_ms_from_env(env)
  slowdowns = parse_slowdowns(env.get(Env.SLOWDOWN, ""))
  if speed == 1.0 and sample_ms is None and not any(s.host == host for s in slowdowns):
    return None
  if sample_ms is not None:
    device = DevicePacer(speed, sample_ms / 1e3)
    return lambda compute_s, step, samples=0: device.pace(
        compute_s, samples, slowdown_factor(slowdowns, host, step))
  pacer = Pacer(speed)
  return lambda compute_s, step, samples=0: pacer.pace(
      compute_s, slowdown_factor(slowdowns, host, step))


def parse_host_env(entries: Sequence[str], hosts: int) -> dict[int, dict[str, str]]:
  """`HOST:KEY=VALUE` entries as {host: {key: value}}: hosts that differ on purpose, e.g.
  `1:XLA_FLAGS=--xla_backend_optimization_level=0` compiles as another GPU generation would."""
  found: dict[int, dict[str, str]] = {}
  for entry in entries:
    host, sep, assignment = entry.partition(":")
    key, eq, value = assignment.partition("=")
    if not (sep and eq and host.strip().isdigit() and key.strip()):
      raise ValueError(f"--host-env {entry!r} must be HOST:KEY=VALUE, e.g. "
                       "1:XLA_FLAGS=--xla_backend_optimization_level=0.")
    h = int(host)
    if h >= hosts:
      raise ValueError(f"--host-env {entry!r} names host {h} but there are {hosts} hosts "
                       f"(0..{hosts - 1}).")
    if key.strip().startswith("HETJAX_") and key.strip() != Env.INPUT_SAMPLE_MS:
      raise ValueError(f"--host-env {entry!r}: the launcher sets the HETJAX_* variables itself; "
                       "use its own flags (--speeds, --slowdown, ...) for those.")
    found.setdefault(h, {})[key.strip()] = value
  return found


# ---- Emulated faults (HETJAX_FAULTS): what the tests and the chaos soak inject ----

# A folder of marker files: each fault fires once per job, whatever the restarts (bench/chaos.py).
FAULTS_ONCE = "HETJAX_FAULTS_ONCE"


@dataclasses.dataclass(frozen=True)
class Fault:
  """EMULATED: host `host` meets fault `kind` at (or after) step `step`.

  Kinds: `stall-in-PHASE` (stops for ever entering lifecycle phase PHASE, threads alive, as a
  hung read), `stall-in-step` (stops inside the step, before the reduction, as a hung device)
  and `fail-write` (that step's checkpoint fails in orbax's commit, as a full disk).
  """

  @property
  def label(self) -> str:
    return f"{self.host}:{self.kind}@{self.step}"

  host: int
  kind: str
  step: int


def parse_faults(text: str) -> list[Fault]:
  """Parses `HOST:KIND@STEP[,HOST:KIND@STEP...]`, e.g. `1:stall-in-evaluation@4,0:fail-write@6`."""
  from hetjax import phases  # Stdlib only.
  out = []
  for item in filter(None, (t.strip() for t in text.split(","))):
    try:
      host, rest = item.split(":", 1)
      kind, step = rest.rsplit("@", 1)
      fault = Fault(int(host), kind.strip(), int(step))
    except ValueError:
      raise ValueError(f"{Env.FAULTS} takes HOST:KIND@STEP items such as 1:stall-in-evaluation@4; "
                       f"got {item!r}.") from None
    phase = fault.kind[len("stall-in-"):] if fault.kind.startswith("stall-in-") else None
    if fault.kind not in ("fail-write", "stall-in-step") and phase not in phases.NAMES:
      raise ValueError(f"{Env.FAULTS} {item!r}: the kinds are fail-write, stall-in-step and "
                       f"stall-in-PHASE, PHASE one of {', '.join(phases.NAMES)}.")
    out.append(fault)
  return out


class Faults:
  """EMULATED: this host's faults; a phase listener (`hetjax.phases`), a step hook, a write hook.

  With `once_dir` (HETJAX_FAULTS_ONCE) each fault fires at most once per job:
  a restarted host that passes the same step again does not meet it again.
  """

  def __init__(self, host: int, faults: Sequence[Fault], *,
               stall: Callable[[], None] | None = None, once_dir: str | None = None):
    self.host = host
    self.faults = [f for f in faults if f.host == host]
    self._stall = stall or (lambda: threading.Event().wait())
    self._once_dir = once_dir

  def _fires(self, fault: Fault) -> bool:
    """Whether `fault` fires now: always, or (with `once_dir`) the first time only."""
    if self._once_dir is None:
      return True
    os.makedirs(self._once_dir, exist_ok=True)
    try:  # O_EXCL: the marker is made by exactly one caller.
      os.close(os.open(os.path.join(self._once_dir, f"fired-{fault.label}"),
                       os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
      return False
    return True

  def _stall_if(self, kind: str, where: str, step: int | None) -> None:
    for f in self.faults:
      if f.kind == kind and (step or 0) >= f.step and self._fires(f):
        print(f"hetjax: emulated fault: host {self.host} stalls in {where} at step {step}",
              file=sys.stderr, flush=True)
        self._stall()

  def phase_started(self, name: str, step: int | None, at: float) -> None:
    del at
    self._stall_if(f"stall-in-{name}", name, step)

  def phase_ended(self, name: str, step: int | None, at: float, failed: bool) -> None:
    pass

  def in_step(self, step: int) -> None:
    """Called inside step `step`, between the local compute and the reduction."""
    self._stall_if("stall-in-step", "step", step)

  def write_error(self, step: int) -> OSError | None:
    """The error the checkpoint of `step` fails with on this host (None: it succeeds)."""
    for f in self.faults:
      if f.kind == "fail-write" and step == f.step and self._fires(f):
        print(f"hetjax: emulated fault: host {self.host}'s checkpoint write of step {step} fails",
              file=sys.stderr, flush=True)
        return OSError(28, f"No space left on device (emulated fault: host {self.host}, "
                           f"step {step})")
    return None


def faults_from_env(host: int, env: Mapping[str, str] = os.environ) -> Faults | None:
  """This host's emulated faults from HETJAX_FAULTS (None when it names none for this host)."""
  found = Faults(host, parse_faults(env.get(Env.FAULTS, "")),
                 once_dir=env.get(FAULTS_ONCE) or None)
  return found if found.faults else None


def with_step_faults(pace: Pace | None, host: int,
                     env: Mapping[str, str] = os.environ) -> Pace | None:
  """`pace` with this host's `stall-in-step` faults inside it (the one hook between the local
  compute and the reduction); one that only stalls reports compute time unchanged."""
  faults = faults_from_env(host, env)
  if faults is None or not any(f.kind == "stall-in-step" for f in faults.faults):
    return pace

  def paced(compute_s: float, step: int, samples: int = 0) -> float:
    faults.in_step(step)
    return compute_s if pace is None else pace(compute_s, step, samples)
  return paced
