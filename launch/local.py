"""Runs a hetjax job as N host processes on this machine (stdlib only).

    .venv/bin/python launch/local.py --hosts 3 --devices-per-host 2 --speeds 1,0.5,0.25 \\
        -- .venv/bin/hetjax train --model cnn

Each host gets HETJAX_COORDINATOR (a free port on 127.0.0.1),
HETJAX_NUM_HOSTS, HETJAX_HOST_ID, HETJAX_CPU_DEVICES and, with --speeds, the
emulated HETJAX_SPEED; its output lines are prefixed with `[host i] `. When a
host fails, every host is stopped with everything it started. Ctrl-C reaches
every host as SIGINT (a user's stop: hetjax hosts save and exit 130, and the
launcher waits for them; Ctrl-C again kills them), SIGTERM as SIGTERM (they
save and exit 75; killed after --grace). The hosts, and what they started,
also die when the launcher itself is killed, even by SIGKILL.

Supervised restarts: with `--max-restarts K`, a failed job (a host exits
non-zero or is killed) is started again, all hosts, with the same command and
a new coordinator port, at most K times; the command resumes from its own
checkpoint folder. A host exiting 75 (`hetjax.exits.PREEMPTED_EXIT`) was
preempted and saved: such restarts have their own budget, `--max-preemptions`
(default 20 with --max-restarts, else 0, so that a preempted run exits 75 for
an outer scheduler to requeue). Each host sees HETJAX_RESTART_COUNT. A host
that exits 69 (`hetjax.exits.STALLED_EXIT`: the step watchdog
stopped a stuck job) is a failure, restarted under --max-restarts, and the
launcher names the stuck host; so is a host the coordination service found
frozen (no heartbeat for --heartbeat-timeout seconds), named in place of the
host that JAX aborted because of it.

The mechanism lives in `hetjax.cluster.procs`; this file only parses the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

try:
  from hetjax.cluster import emulate, launcher_cli, procs
except ImportError:  # Run from a checkout without installing hetjax.
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from hetjax.cluster import emulate, launcher_cli, procs


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="launch/local.py",
      usage="%(prog)s --hosts N [--devices-per-host D] [--speeds 1,0.5,...] "
            "[--device-sample-ms MS] [--slowdown H:F@S] [--host-env H:K=V] [--init-timeout S] "
            "[--heartbeat-timeout S] [--max-restarts K] -- COMMAND ...",
      description="Run COMMAND as N hetjax hosts on localhost (CPU emulation).")
  parser.add_argument("--hosts", type=int, required=True, help="number of host processes")
  parser.add_argument("--devices-per-host", type=int, default=1,
                      help="emulated CPU devices per host (default 1)")
  parser.add_argument("--speeds", type=str, default=None,
                      help="emulated relative host speeds, e.g. 1,0.5,0.25; fastest is 1.0")
  parser.add_argument("--device-sample-ms", type=float, default=None,
                      help="emulated device milliseconds per sample on the fastest host: a host's "
                           "step takes its real compute plus samples x ms / speed")
  parser.add_argument("--slowdown", type=str, default=None,
                      help="emulated stragglers, HOST:FACTOR@STEP[,...], e.g. 2:3@50")
  parser.add_argument("--host-env", action="append", default=[], metavar="HOST:KEY=VALUE",
                      help="an environment variable for one host only, e.g. "
                           "1:XLA_FLAGS=--xla_backend_optimization_level=0 (emulates hosts that "
                           "compile differently); repeatable")
  parser.add_argument("--init-timeout", type=float, default=None,
                      help="seconds a host may take to join the cluster")
  launcher_cli.add_heartbeat_argument(parser)
  launcher_cli.add_stop_arguments(
      parser, "seconds between SIGTERM and SIGKILL when stopping hosts (after a Ctrl-C: once "
              "the first host has ended)")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: sys.argv[1:]), runs the hosts, returns the exit code."""
  parser = _parser()
  args, command = launcher_cli.parse(parser, argv)
  try:
    speeds = None if args.speeds is None else emulate.parse_speeds(args.speeds)
    return procs.launch_local(command, hosts=args.hosts, devices_per_host=args.devices_per_host,
                              speeds=speeds, init_timeout_s=args.init_timeout,
                              grace_s=args.grace, slowdown=args.slowdown,
                              device_sample_ms=args.device_sample_ms,
                              host_env=emulate.parse_host_env(args.host_env, args.hosts),
                              max_restarts=args.max_restarts, max_preemptions=args.max_preemptions,
                              heartbeat_timeout_s=args.heartbeat_timeout)
  except ValueError as e:
    parser.error(str(e))  # Exits 2 with the usage line.


if __name__ == "__main__":
  sys.exit(main())
