"""The settings of the rounds modes and their command-line flags (no JAX here).

Every bad value is refused here, before JAX starts, with the value, the
limit and the fix. A flag that does not apply to the chosen mode is an
error too: a silently ignored `--elastic-beta` is a wrong experiment.
"""

from __future__ import annotations

import argparse
import dataclasses

MODES = ("sync", "hybrid", "elastic")
OUTER_OPTIMIZERS = ("sgd", "nesterov")

# flag -> the modes it applies to
_APPLIES = {
    "round_steps": ("hybrid", "elastic"),
    "local_steps": ("hybrid", "elastic"),
    "local_batch": ("hybrid", "elastic"),
    "outer_optimizer": ("hybrid",),
    "outer_lr": ("hybrid",),
    "outer_momentum": ("hybrid",),
    "elastic_beta": ("elastic",),
}


@dataclasses.dataclass(frozen=True)
class RoundsConfig:
  """What a hybrid or elastic run adds to `TrainConfig`.

  Attributes:
    mode: 'hybrid' or 'elastic'.
    round_steps: H, local steps of the fastest host per round; host i runs
      `tau_i = max(1, round(H * v_i / v_max))` with v its measured local
      steps per second.
    local_steps: fixed per-host local steps per round (overrides the speeds);
      reproducible, so resumed runs continue exactly.
    local_batch: samples of one local step of one host; None = global batch
      / hosts.
    outer_optimizer: hybrid's outer optax optimizer, 'sgd' or 'nesterov'.
    outer_lr, outer_momentum: its learning rate and momentum (DiLoCo's 0.7
      and 0.9 by default; momentum 0 = plain SGD).
    elastic_beta: EASGD's moving rate; host i moves `beta * n_i / sum n` of
      the way to the centre each round.
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
    if self.mode not in MODES[1:]:
      raise ValueError(f"unknown rounds mode {self.mode!r}; choose 'hybrid' or 'elastic' "
                       "('sync' is hetjax.Trainer).")
    if self.round_steps < 1:
      raise ValueError(f"--round-steps must be >= 1 local step of the fastest host per round, "
                       f"got {self.round_steps}.")
    if self.local_steps is not None:
      if any(int(t) < 1 for t in self.local_steps):
        raise ValueError(f"--local-steps {','.join(map(str, self.local_steps))}: every host "
                         "needs >= 1 local step per round.")
      if num_hosts is not None and len(self.local_steps) != num_hosts:
        raise ValueError(f"--local-steps {','.join(map(str, self.local_steps))} gives "
                         f"{len(self.local_steps)} count(s) for {num_hosts} host(s); give one "
                         "per host, e.g. " + ",".join(["1"] * num_hosts) + ".")
    if self.local_batch is not None and self.local_batch < 1:
      raise ValueError(f"--local-batch must be >= 1 sample, got {self.local_batch}.")
    if num_hosts is not None and global_batch is not None and self.local_batch is None \
        and global_batch < num_hosts:
      raise ValueError(f"--global-batch {global_batch} gives each of {num_hosts} hosts less "
                       f"than one sample per local step; raise it or set --local-batch.")
    if self.outer_optimizer not in OUTER_OPTIMIZERS:
      raise ValueError(f"unknown --outer-optimizer {self.outer_optimizer!r}; choose "
                       f"{' or '.join(OUTER_OPTIMIZERS)}.")
    if not self.outer_lr > 0:
      raise ValueError(f"--outer-lr must be > 0, got {self.outer_lr}.")
    if not 0 <= self.outer_momentum < 1:
      raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}.")
    if not 0 < self.elastic_beta <= 1:
      raise ValueError(f"--elastic-beta must be in (0, 1], got {self.elastic_beta}: it is "
                       "the share of the way to the centre the hosts move each round.")

  def local_batch_for(self, global_batch: int, num_hosts: int) -> int:
    return self.local_batch if self.local_batch is not None else global_batch // num_hosts


def parse_local_steps(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(t) for t in text.split(","))
  except ValueError:
    raise ValueError(f"--local-steps {text!r} must be comma-separated whole numbers, one per "
                     "host, e.g. 4,2,1.") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
  """The mode flags; their defaults are None so that a flag given to the wrong mode is seen."""
  g = p.add_argument_group("modes (hybrid: local SGD across hosts; elastic: EASGD rounds)")
  g.add_argument("--mode", default="sync", choices=MODES,
                 help="sync (one reduction per step), hybrid or elastic (one per round)")
  g.add_argument("--round-steps", type=int, default=None,
                 help="hybrid/elastic: local steps of the fastest host per round (default 4)")
  g.add_argument("--local-steps", default=None,
                 help="hybrid/elastic: fixed local steps per host, e.g. 4,2,1 (default: from speeds)")
  g.add_argument("--local-batch", type=int, default=None,
                 help="hybrid/elastic: samples per local step of a host (default global batch / hosts)")
  g.add_argument("--outer-optimizer", default=None,
                 help="hybrid: sgd or nesterov (default nesterov)")
  g.add_argument("--outer-lr", type=float, default=None, help="hybrid: outer learning rate (0.7)")
  g.add_argument("--outer-momentum", type=float, default=None,
                 help="hybrid: outer momentum (0.9; 0 with sgd = plain averaging steps)")
  g.add_argument("--elastic-beta", type=float, default=None,
                 help="elastic: moving rate towards the centre per round, in (0, 1] (0.9)")


def from_args(args: argparse.Namespace, num_hosts: int | None = None) -> RoundsConfig | None:
  """The `RoundsConfig` of the command line (None for --mode sync); raises ValueError."""
  given = [k for k in _APPLIES if getattr(args, k, None) is not None]
  wrong = [k for k in given if args.mode not in _APPLIES[k]]
  if wrong:
    flag = "--" + wrong[0].replace("_", "-")
    raise ValueError(f"{flag} does not apply to --mode {args.mode}; it is for --mode "
                     f"{' or '.join(_APPLIES[wrong[0]])}. Drop it, or choose that mode.")
  if args.mode == "sync":
    return None
  if getattr(args, "balancer", None) is not None:
    raise ValueError(f"--balancer does not apply to --mode {args.mode}: its hosts run local "
                     "steps of one size and the round's step counts come from their speeds "
                     "(or --local-steps).")
  if getattr(args, "data_workers", None) is not None:
    raise ValueError(f"--data-workers does not apply to --mode {args.mode}: a round reads its "
                     "records in the training thread.")
  if getattr(args, "assignment", "equal") != "equal":
    raise ValueError(f"--assignment does not apply to --mode {args.mode}; use --local-steps.")
  values = {k: getattr(args, k) for k in given}
  if "local_steps" in values:
    values["local_steps"] = parse_local_steps(values["local_steps"])
  config = RoundsConfig(mode=args.mode, **values)
  config.validate(num_hosts, getattr(args, "global_batch", None))
  return config

