"""What a run is told: its configs and the environment's names, with no JAX.

`validate()` runs before JAX loads, so a bad value fails in a second, naming
the value, the limit and the fix. Messages name fields in backticks; the
command line words them as flags (`hetjax.cli.flags`), whose help is each
field's `Args:` entry below.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile


class Env:
  """The `HETJAX_*` environment variables, in one table (`EMULATION`: emulated runs only)."""

  COORDINATOR = "HETJAX_COORDINATOR"      # host:port of process 0's coordinator
  NUM_HOSTS = "HETJAX_NUM_HOSTS"
  HOST_ID = "HETJAX_HOST_ID"
  INIT_TIMEOUT = "HETJAX_INIT_TIMEOUT"    # seconds to reach the coordinator
  CPU_DEVICES = "HETJAX_CPU_DEVICES"      # emulated CPU devices per host
  GLOO_INTERFACE = "HETJAX_GLOO_INTERFACE"
  PORT = "HETJAX_PORT"                    # the coordinator's port under SLURM
  RESTART_COUNT = "HETJAX_RESTART_COUNT"  # which attempt this is, under --max-restarts
  SPEED = "HETJAX_SPEED"                  # emulated relative speed of this host
  SLOWDOWN = "HETJAX_SLOWDOWN"            # emulated stragglers, HOST:FACTOR@STEP,...
  DEVICE_SAMPLE_MS = "HETJAX_DEVICE_SAMPLE_MS"  # emulated device time per sample
  INPUT_SAMPLE_MS = "HETJAX_INPUT_SAMPLE_MS"  # emulated input (decode) time per sample, per reader
  SHOW_GLOO = "HETJAX_SHOW_GLOO"          # 1: launchers show gloo's "Rank i is connected" lines
  HEARTBEAT_TIMEOUT = "HETJAX_HEARTBEAT_TIMEOUT"  # seconds without heartbeats: a host is dead
  FAULTS = "HETJAX_FAULTS"                # emulated faults, HOST:KIND@STEP,... (tests, chaos)
  SERVICE = "HETJAX_SERVICE"              # "launcher": the coordination service runs beside host 0

  EMULATION = (SPEED, SLOWDOWN, DEVICE_SAMPLE_MS, INPUT_SAMPLE_MS)


def num_hosts_from_env(default: int = 1) -> int:
  """HETJAX_NUM_HOSTS, or `default` where a launcher has not set it (yet)."""
  return int(os.environ.get(Env.NUM_HOSTS) or default)


def host_id_from_env() -> int:
  return int(os.environ.get(Env.HOST_ID) or 0)


def emulated_from_env() -> bool:
  """Whether this process runs with emulated speeds or stragglers."""
  return any(k in os.environ for k in Env.EMULATION)


REDUCTIONS = ("auto", "device", "host")
BALANCERS = ("equal", "static", "dynamic")
PRECISIONS = ("fp32", "bf16", "fp16")


def check_at_least(name: str, value: int, least: int, meaning: str = "") -> None:
  """The one wording of "must be >= N" used by every config (`name`: the field, in backticks)."""
  if value < least:
    raise ValueError(f"{name} must be >= {least}{meaning}, got {value}.")


def check_choice(name: str, value: object, choices: tuple, note: str = "") -> None:
  """The one wording of "unknown X; choose one of ..." (`note`: what else is allowed)."""
  if value not in choices:
    raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}{note}.")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What every host must agree on (compared by hash before training).

  Args:
    global_batch: samples per step over all hosts; fixed for the whole run.
    microbatch: samples per block, run whole by one device; a host's share is whole blocks.
    seed: seeds the parameters and the data order.
    assignment: 'equal' (in blocks) or per-host shares in whole blocks, e.g. (4, 24, 36).
    reduction: the cross-host reduction: 'auto' ('device' unless two processes drive
      one GPU), 'device' (one fused program: NCCL or gloo) or 'host' (gloo on the CPUs).
    balancer: None (follow `assignment`), 'equal', 'static' (profile a warm-up, then
      fix the split) or 'dynamic' (re-size shares from the measured step times).
    augment: per-example augmentation, e.g. 'crop,flip', keyed by the example's index.
    check_every: compare the hosts' parameter fingerprints every N steps (0: at checkpoints).
    precision: compute type, 'fp32', 'bf16' or 'fp16' (loss scaling).
    watchdog_s: seconds a step may wait on the other hosts without progress before
      the job stops naming them (longer for building, evaluation, checkpoints);
      None: max(20 x the median step, 5 minutes); 0: no stall checks.
    device_batch: blocks per device in a host's largest program (`k`): one for every
      host, one per host (e.g. 16,8,2), or 'auto' (from memory and speed); exact.
    device_batch_memory_fraction: under 'auto', the device memory share a program may fill.
    update_layout: the sharded update's layout: 'auto' (probed), 'whole' or 'sliced'; exact.
    shard_within_host: 'off', 'on' (parameters and gradient sums split over a host's
      devices), 'auto' (on where the state does not fit), or one per host; exact.
    device_memory: a device's memory in GB for 'auto' where none is reported (XLA:CPU).

  Example:
    >>> config = hetjax.TrainConfig(global_batch=64, microbatch=8, balancer="dynamic")
    >>> config.validate(num_hosts=3)
    >>> hetjax.TrainConfig(global_batch=0).validate()
    Traceback (most recent call last):
    ...
    ValueError: `global_batch` must be >= 1, got 0.
  """

  global_batch: int
  microbatch: int = 16
  seed: int = 0
  assignment: str | tuple[int, ...] = "equal"
  reduction: str = "auto"
  balancer: str | None = None
  augment: str = "none"
  check_every: int = 100
  precision: str = "fp32"
  watchdog_s: float | None = None
  device_batch: int | tuple[int, ...] | str = 1
  device_batch_memory_fraction: float = 0.8
  update_layout: str = "auto"
  shard_within_host: str | tuple[str, ...] = "off"
  device_memory: float | None = None

  def validate(self, num_hosts: int | None = None) -> None:
    """Raises ValueError naming the value, the limit and the fix (`num_hosts`, where
    known, also checks an explicit assignment's length)."""
    from hetjax import balancer as balancer_lib  # numpy only
    from hetjax import blocks as blocks_lib
    from hetjax.input import augment as augment_lib

    check_at_least("`global_batch`", self.global_batch, 1)
    check_at_least("`microbatch`", self.microbatch, 1)
    check_choice("reduction backend", self.reduction, REDUCTIONS)
    if self.balancer is not None:
      check_choice("balancer", self.balancer, BALANCERS, " (or None to follow the assignment)")
    check_choice("precision", self.precision, PRECISIONS)
    augment_lib.parse(self.augment)  # Raises on an unknown augmentation.
    assignment = (balancer_lib.parse_assignment(self.assignment)
                  if isinstance(self.assignment, str) else tuple(self.assignment))
    if self.balancer in ("static", "dynamic") and assignment != "equal":
      raise ValueError(f"`balancer` {self.balancer!r} sizes the shares itself; drop the explicit "
                       f"`assignment` {self.assignment} (or use the 'equal' balancer).")
    if assignment != "equal":
      if num_hosts is not None:
        balancer_lib.validate_shares(assignment, self.global_batch, num_hosts)
      blocks_lib.check_aligned(assignment, self.global_batch, self.microbatch)
    check_at_least("`check_every`", self.check_every, 0, " steps (0: only at checkpoints)")
    if self.watchdog_s is not None and not self.watchdog_s >= 0:
      raise ValueError(f"`watchdog_s` must be >= 0 seconds (0: off; unset: 20 x the median step, "
                       f"at least 5 minutes), got {self.watchdog_s}.")
    check_device_batch(self.device_batch, self.device_batch_memory_fraction, num_hosts)
    check_choice("`update_layout`", self.update_layout, UPDATE_LAYOUTS)
    check_shard_within_host(self.shard_within_host, num_hosts)
    if self.device_memory is not None and not float(self.device_memory) > 0:
      raise ValueError(f"`device_memory` must be > 0 GB (unset: what the device reports), "
                       f"got {self.device_memory}.")

  def device_batches(self, num_hosts: int) -> tuple[int, ...] | None:
    """Every host's device batch `k`; None under 'auto' (the hosts choose at start)."""
    parsed = parse_device_batch(self.device_batch)
    if parsed == AUTO:
      return None
    check_device_batch(parsed, num_hosts=num_hosts)
    return parsed * num_hosts if len(parsed) == 1 else parsed


AUTO = "auto"
SHARD_WITHIN_HOST = ("auto", "on", "off")  # per host (hetjax.step.within_host)


def check_shard_within_host(value: str | tuple[str, ...], num_hosts: int | None = None) -> None:
  """Raises ValueError unless `value` is one of `SHARD_WITHIN_HOST`, or one per host."""
  parts = ([p.strip() for p in value.split(",")] if isinstance(value, str) else list(value))
  bad = [p for p in parts if p not in SHARD_WITHIN_HOST]
  if bad or not parts:
    raise ValueError(f"`shard_within_host` {value!r}: choose {', '.join(SHARD_WITHIN_HOST)}, "
                     "or one per host ('off,off,on').")
  if len(parts) > 1 and num_hosts is not None and len(parts) != num_hosts:
    raise ValueError(f"`shard_within_host` {value!r} gives {len(parts)} values for {num_hosts} "
                     "hosts; give one value, or one per host.")


UPDATE_LAYOUTS = ("auto", "sliced", "whole")  # the sharded update's (hetjax.step.optimizer_layout)


def parse_device_batch(value: int | str | tuple[int, ...] | list) -> tuple[int, ...] | str:
  """`device_batch` as given ('16,8,2', 4, (4, 2), 'auto') -> a tuple of ints or 'auto'."""
  if isinstance(value, str):
    text = value.strip()
    if text.lower() == AUTO:
      return AUTO
    parts = [p.strip() for p in text.split(",")]
  elif isinstance(value, (list, tuple)):
    parts = list(value)
  else:
    parts = [value]
  out = []
  for p in parts:
    if isinstance(p, bool) or (isinstance(p, float) and not p.is_integer()):
      p = str(p)
    try:
      out.append(int(p))
    except (TypeError, ValueError):
      raise ValueError(f"`device_batch` {value!r}: {p!r} is not a whole number of blocks; give "
                       "one count per host (e.g. 16,8,2), one for every host (e.g. 4) or "
                       "'auto'.") from None
  return tuple(out)


def check_device_batch(value: int | str | tuple[int, ...], memory_fraction: float = 0.8,
                       num_hosts: int | None = None) -> None:
  """Raises ValueError naming the value, the limit and the fix (no JAX)."""
  parsed = parse_device_batch(value)
  if not 0 < memory_fraction <= 1:
    raise ValueError(f"`device_batch_memory_fraction` must be in (0, 1], got {memory_fraction}: "
                     "the share of a device's memory 'auto' may fill (default 0.8).")
  if parsed == AUTO:
    return
  shown = ",".join(map(str, parsed))
  if not parsed or any(k < 1 for k in parsed):
    raise ValueError(f"`device_batch` {shown}: every host needs >= 1 block per device per "
                     "micro-batch (1: one block, the default; or 'auto').")
  if num_hosts is not None and len(parsed) not in (1, num_hosts):
    raise ValueError(f"`device_batch` {shown} gives {len(parsed)} values for {num_hosts} "
                     f"host(s); give one per host (e.g. {','.join(['4'] * num_hosts)}), one for "
                     "every host, or 'auto'.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Where and how often to checkpoint.

  Args:
    directory: the checkpoint folder shared by all hosts: a path or a URL (gs://...).
    every: save every this many steps (and always at the end of `fit`).
    keep: keep the newest this many checkpoints.
    resume: continue from the newest complete checkpoint in `directory`.
    async_save: write in the background while training goes on.

  Example:
    >>> import tempfile
    >>> ckpt = hetjax.CheckpointConfig(tempfile.mkdtemp(), every=50, keep=2)
    >>> ckpt.validate()  # A folder that cannot take checkpoints fails here, not at step 50.
  """

  directory: str
  every: int = 100
  keep: int = 3
  resume: bool = True
  async_save: bool = True

  def validate(self) -> None:
    check_at_least("`every`", self.every, 1, " step")
    check_at_least("`keep`", self.keep, 1, " checkpoint")
    check_writable(self.directory)


def is_remote(directory: str) -> bool:
  """A URL (gs://, s3://, ...) that orbax reaches through etils.epath, not a local path."""
  return "://" in str(directory)


def resolve(directory: str) -> str:
  """The folder as messages name it: local paths absolute, URLs unchanged."""
  return str(directory) if is_remote(directory) else os.path.abspath(directory)


def check_writable(directory: str) -> None:
  """Fails now, not after hours of training, if a local `directory` cannot take checkpoints
  (a URL is left to orbax: a probe per host would prove little)."""
  if is_remote(directory):
    return
  path = os.path.abspath(directory)
  blocker = path
  while blocker and not os.path.exists(blocker):
    blocker = os.path.dirname(blocker)
  if os.path.exists(blocker) and not os.path.isdir(blocker):
    where = "is a file" if blocker == path else f"lies under {blocker}, which is a file"
    raise ValueError(f"checkpoint folder {path} {where}, not a folder; choose another "
                     "`directory`.")
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".hetjax-write-probe-"):
      pass
  except OSError as e:
    raise ValueError(f"checkpoint folder {path} is not writable ({e.strerror or e}); choose "
                     "another `directory` or fix its permissions.") from None


MODES = ("sync", "hybrid", "elastic")
OUTER_OPTIMIZERS = ("sgd", "nesterov")


@dataclasses.dataclass(frozen=True)
class RoundsConfig:
  """What a hybrid or elastic run adds to `TrainConfig` (held by `hetjax.Hybrid` and
  `hetjax.Elastic`).

  Args:
    mode: 'hybrid' or 'elastic', one cross-host reduction per round (the command line
      also takes 'sync', the default: one per step).
    round_steps: H, local steps of the fastest host per round; host i runs
      `max(1, round(H * v_i / v_max))`, v its measured local steps per second.
    local_steps: fixed per-host local steps per round (reproducible; overrides speeds).
    local_batch: samples of one host's local step; None = global batch / hosts.
    outer_optimizer: hybrid's outer optax optimizer, 'sgd' or 'nesterov'.
    outer_lr, outer_momentum: its learning rate and momentum (DiLoCo's 0.7
      and 0.9 by default; momentum 0 = plain SGD).
    elastic_beta: EASGD's moving rate; host i moves `beta * n_i / sum n` of
      the way to the centre each round.

  Example:
    >>> from hetjax.config import RoundsConfig
    >>> rounds = RoundsConfig(mode="hybrid", local_steps=(4, 2, 1))
    >>> rounds.validate(num_hosts=3, global_batch=48)
    >>> rounds.local_batch_for(48, 3)
    16
  """

  mode: str = "hybrid"
  round_steps: int = 4
  local_steps: tuple[int, ...] | None = None
  local_batch: int | None = None
  outer_optimizer: str = "nesterov"
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  elastic_beta: float = 0.9

  def validate(self, num_hosts: int | None = None, global_batch: int | None = None) -> None:
    """Raises ValueError naming the value, the limit and the fix (`num_hosts`, where known,
    also checks `local_steps`' length; `global_batch`, that every host gets a sample)."""
    if self.mode not in MODES[1:]:
      raise ValueError(f"unknown rounds `mode` {self.mode!r}; choose 'hybrid' or 'elastic' "
                       "('sync' needs no RoundsConfig).")
    check_at_least("`round_steps`", self.round_steps, 1,
                   " local step of the fastest host per round")
    if self.local_steps is not None:
      shown = ",".join(map(str, self.local_steps))
      if any(int(t) < 1 for t in self.local_steps):
        raise ValueError(f"`local_steps` {shown}: every host needs >= 1 local step per round.")
      if num_hosts is not None and len(self.local_steps) != num_hosts:
        raise ValueError(f"`local_steps` {shown} gives {len(self.local_steps)} count(s) for "
                         f"{num_hosts} host(s); give one per host, e.g. "
                         + ",".join(["1"] * num_hosts) + ".")
    if self.local_batch is not None:
      check_at_least("`local_batch`", self.local_batch, 1, " sample")
    if num_hosts is not None and global_batch is not None and self.local_batch is None \
        and global_batch < num_hosts:
      raise ValueError(f"`global_batch` {global_batch} gives each of {num_hosts} hosts less "
                       f"than one sample per local step; raise it or set `local_batch`.")
    check_choice("`outer_optimizer`", self.outer_optimizer, OUTER_OPTIMIZERS)
    if not self.outer_lr > 0:
      raise ValueError(f"`outer_lr` must be > 0, got {self.outer_lr}.")
    if not 0 <= self.outer_momentum < 1:
      raise ValueError(f"`outer_momentum` must be in [0, 1), got {self.outer_momentum}.")
    if not 0 < self.elastic_beta <= 1:
      raise ValueError(f"`elastic_beta` must be in (0, 1], got {self.elastic_beta}: it is "
                       "the share of the way to the centre the hosts move each round.")

  def check_split(self, balancer: str | None, assignment: str | tuple[int, ...],
                  shard_within_host: str | tuple[str, ...] = "off") -> None:
    """A rounds mode sizes the hosts' work by local steps: no `balancer`, no `assignment`;
    its hosts hold whole parameters on every device: no `shard_within_host`."""
    values = (shard_within_host.split(",") if isinstance(shard_within_host, str)
              else shard_within_host)
    if any(v.strip() != "off" for v in values):
      raise ValueError(f"`shard_within_host` {shard_within_host!r} applies to the sync mode "
                       f"only: `mode` {self.mode}'s local steps hold whole parameters on every "
                       "device; leave `shard_within_host` off.")
    if balancer is not None:
      raise ValueError(f"`balancer` does not apply to `mode` {self.mode}: its hosts run local "
                       "steps of one size and the round's step counts come from their speeds "
                       "(or `local_steps`).")
    if assignment != "equal":
      raise ValueError(f"`assignment` does not apply to `mode` {self.mode}; use `local_steps`.")

  def local_batch_for(self, global_batch: int, num_hosts: int) -> int:
    """Samples of one local step of one host: `local_batch`, or an equal share."""
    return self.local_batch if self.local_batch is not None else global_batch // num_hosts


def fingerprint(text: str):
  """A hash of `text` as four 16-bit chunks (float32 numpy), exact in a collective's rows:
  how hosts compare what they were told through one small collective."""
  import hashlib

  import numpy as np
  digest = hashlib.sha256(text.encode()).digest()[:8]
  return np.frombuffer(digest, dtype=np.uint16).astype(np.float32)
