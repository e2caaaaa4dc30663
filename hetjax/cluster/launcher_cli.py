"""The command line both launchers share (`launch/local.py`, `launch/hosts.py`): stopping,
restarts, heartbeats and `ARGS -- COMMAND` are one behaviour, spelled once. Stdlib only.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from hetjax.cluster.hostenv import split_command
from hetjax.cluster.hostgroup import DEFAULT_GRACE_S
from hetjax.cluster.supervise import add_restart_arguments, check_restarts


def add_stop_arguments(parser: argparse.ArgumentParser, grace_help: str) -> None:
  """Adds --grace (`grace_help` says what it stops) and the restart budgets."""
  parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help=grace_help)
  add_restart_arguments(parser)


def add_heartbeat_argument(parser: argparse.ArgumentParser) -> None:
  """Adds --heartbeat-timeout S, passed to every host as HETJAX_HEARTBEAT_TIMEOUT."""
  parser.add_argument("--heartbeat-timeout", type=int, default=None, metavar="S",
                      help="seconds without heartbeats before a host counts as dead (frozen or "
                           "unreachable) and the job stops naming it (default 100, JAX's; "
                           "HETJAX_HEARTBEAT_TIMEOUT)")


def parse(parser: argparse.ArgumentParser,
          argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
  """`argv` (default: sys.argv[1:]) as (the launcher's arguments, the host command); a bad
  --grace, restart budget or heartbeat timeout exits 2 with the usage line, before any start."""
  own, command = split_command(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(own)
  try:
    if args.grace < 0:
      raise ValueError(f"--grace must be >= 0 seconds, got {args.grace!r}.")
    check_restarts(args.max_restarts, args.max_preemptions)
    heartbeat = getattr(args, "heartbeat_timeout", None)
    if heartbeat is not None and heartbeat < 1:
      raise ValueError(f"--heartbeat-timeout must be a whole number of seconds >= 1, "
                       f"got {heartbeat!r}.")
  except ValueError as e:
    parser.error(str(e))  # Exits 2 with the usage line.
  return args, command
