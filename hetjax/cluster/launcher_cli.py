"""The command line that both launchers share (`launch/local.py`, `launch/hosts.py`).

How a launcher stops and restarts its hosts (--grace, --max-restarts,
--max-preemptions), and its own arguments standing before `-- COMMAND`, are
one behaviour in both, so they are spelled once. Stdlib only: the launchers
never import JAX.
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


def parse(parser: argparse.ArgumentParser,
          argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
  """`argv` (default: sys.argv[1:]) as (the launcher's arguments, the host command).

  A negative --grace or a restart budget that is not a count exits 2 with
  the usage line, before anything starts.
  """
  own, command = split_command(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(own)
  try:
    if args.grace < 0:
      raise ValueError(f"--grace must be >= 0 seconds, got {args.grace!r}.")
    check_restarts(args.max_restarts, args.max_preemptions)
  except ValueError as e:
    parser.error(str(e))  # Exits 2 with the usage line.
  return args, command
