"""The exit codes the hosts leave with and the launchers act on, in one table.

A code means one thing wherever it is written or read. The shell launchers
(`launch/*.sbatch`) repeat 75 with a pointer here (tests/test_cluster_launchers.py
checks). `JobExit` lets the command line leave with the right code without
importing the modules (and JAX) that raise it. Stdlib only.
"""

from __future__ import annotations

import signal

FAILED_EXIT = 1         # Something went wrong; a launcher restarts it under --max-restarts.
USAGE_EXIT = 2          # A bad flag, config file or value: fix the command; never restarted.
# The step watchdog stopped a stuck job (`hetjax.cluster.watchdog`): a host,
# or the link to it, stopped answering ("service unavailable", EX_UNAVAILABLE
# from sysexits.h). Not 75 (a preemption, which saved) nor 124 (a launcher's
# own deadline, never restarted): a failure that a restart from the last
# checkpoint is expected to cure, under --max-restarts.
STALLED_EXIT = 69
# A checkpoint could not be written (`hetjax.checkpoint.write_failed`;
# EX_IOERR from sysexits.h). A restart would meet the same full disk at the
# same save, so it is never restarted.
WRITE_FAILED_EXIT = 74
# Preempted (SIGTERM) and saved what it needs to resume: "restart me", not
# "I failed" (EX_TEMPFAIL from sysexits.h, which schedulers and shells read
# as "try again later"). Restarted under --max-preemptions, else passed on
# for an outer scheduler to requeue.
PREEMPTED_EXIT = 75
# A user's Ctrl-C (128 + SIGINT, what shells report): a stop, never restarted.
INTERRUPTED_EXIT = 128 + signal.SIGINT


class JobExit(RuntimeError):
  """An error after which every host leaves with `exit_code` (the command line's exit code).

  Subclassed where a job ends on purpose (`Stopped`, `CheckpointWriteFailed`,
  `HostsDisagree`); `label` starts the one-line message ("error: " for a fault).

  Example:
    >>> from hetjax import exits
    >>> class Drained(exits.JobExit):
    ...   exit_code = exits.PREEMPTED_EXIT
    >>> Drained("the node is being drained").exit_code
    75
  """

  exit_code = FAILED_EXIT
  label = ""
