"""The modes' command-line flags (no JAX here): `--mode` and the rounds modes' settings.

They become a `hetjax.config.RoundsConfig`, whose `validate()` refuses a bad
value before JAX starts, worded here as flags (`hetjax.cli.flags`). A flag
that does not apply to the chosen mode is an error too: a silently ignored
`--elastic-beta` is a wrong experiment.
"""

from __future__ import annotations

import argparse
import re

from hetjax.config import MODES, RoundsConfig

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
  if getattr(args, "data_workers", None) is not None:
    raise ValueError(f"--data-workers does not apply to --mode {args.mode}: a round reads its "
                     "records in the training thread.")
  values = {k: getattr(args, k) for k in given}
  if "local_steps" in values:
    values["local_steps"] = parse_local_steps(values["local_steps"])
  config = RoundsConfig(mode=args.mode, **values)
  try:
    config.check_split(getattr(args, "balancer", None), getattr(args, "assignment", "equal"),
                       getattr(args, "shard_within_host", None) or "off")
    config.validate(num_hosts, getattr(args, "global_batch", None))
  except ValueError as e:  # Every field it names is the flag of its name with dashes.
    raise ValueError(re.sub(r"`(\w+)`", lambda m: "--" + m.group(1).replace("_", "-"),
                            str(e))) from None
  return config
