"""Supervising a job: how a group of hosts ended, who is to blame, whether to restart.

The exit codes (`hetjax.exits`) as docs/cluster.md's table restarts them: 75
under --max-preemptions, else passed on for an outer scheduler; 130 and 74
never; 69 and other failures under --max-restarts. A host that JAX aborts
(SIGABRT) because a peer stopped its heartbeats is a failure of that peer,
which the message names. Stdlib only: this module must never import JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import signal
import sys
from typing import Callable, Collection, Sequence

from hetjax.cluster import ending
from hetjax.cluster import lost_peer
from hetjax.cluster import watchdog
from hetjax.exits import (INTERRUPTED_EXIT, PREEMPTED_EXIT, STALLED_EXIT,  # noqa: F401 (re-exported)
                          WRITE_FAILED_EXIT)

# Restarts after preemptions are not failures, so they have their own budget;
# a bound still stops a job that reports preemption at every start.
DEFAULT_MAX_PREEMPTIONS = 20


@dataclasses.dataclass
class Outcome:
  """How a group of hosts ended: `returncodes` negative for a signal; `signal` the one that
  made the launcher stop them; the host lists as `Findings` read them; `service_stopped` how a
  launcher-run coordination service ended by itself (None otherwise).
  """

  returncodes: list[int | None]
  failed_host: int | None = None
  signal: int | None = None
  timed_out: bool = False
  tails: list[list[str]] = dataclasses.field(default_factory=list)
  unresponsive: list[int] = dataclasses.field(default_factory=list)
  stalled: list[int] = dataclasses.field(default_factory=list)
  write_failed_hosts: list[int] = dataclasses.field(default_factory=list)
  reactions: list[int] = dataclasses.field(default_factory=list)
  service_stopped: int | None = None

  def blamed(self) -> list[int]:
    """The hosts that caused the failure: those named by the hosts' own reports, else the first."""
    if self.ok or self.signal is not None or self.timed_out:
      return []
    if self.unresponsive:
      return list(self.unresponsive)
    rc = self.returncodes[self.failed_host]
    if self.stalled and rc == STALLED_EXIT:
      return list(self.stalled)
    if self.write_failed_hosts and rc == WRITE_FAILED_EXIT:
      return list(self.write_failed_hosts)
    return [self.failed_host]

  @property
  def ok(self) -> bool:
    return self.failed_host is None and self.signal is None and not self.timed_out

  @property
  def stopped_by_user(self) -> bool:
    """Whether a user's Ctrl-C ended the hosts (to the launcher or to a host)."""
    if self.signal is not None:
      return self.signal == signal.SIGINT
    return (not self.timed_out and self.failed_host is not None
            and self.returncodes[self.failed_host] in (INTERRUPTED_EXIT, -signal.SIGINT))

  @property
  def preempted(self) -> bool:
    """Whether the hosts stopped because one was preempted (exit PREEMPTED_EXIT), not failed."""
    return (self.signal is None and not self.timed_out and self.failed_host is not None
            and self.returncodes[self.failed_host] == PREEMPTED_EXIT)

  @property
  def write_failed(self) -> bool:
    """Whether the hosts stopped because a checkpoint could not be written (WRITE_FAILED_EXIT)."""
    return (self.signal is None and not self.timed_out and self.failed_host is not None
            and self.returncodes[self.failed_host] == WRITE_FAILED_EXIT)

  def exit_code(self) -> int:
    """A shell-style exit code: 0, the failed host's code, or 128 + signal."""
    if self.signal is not None:
      return 128 + self.signal
    if self.timed_out:
      return 124  # As timeout(1) does.
    if self.failed_host is not None:
      rc = self.returncodes[self.failed_host] or 1
      return rc if rc > 0 else 128 - rc
    return 0


def first_failure(codes: Sequence[int | None],
                  exit_times: Sequence[float | None] | None = None,
                  reactions: Collection[int] = ()) -> int | None:
  """The host to blame among those that exited non-zero by themselves, if any.

  A dead host's peers fail soon after in their shared collective, so rank: a
  host killed from outside (SIGABRT is JAX ending a peer's survivor, not that);
  then one that neither said it reacted (`reactions`) nor was aborted; then the
  earliest `exit_times` (None: all equal); then a failure before a preemption
  (a crash restarted as "preempted" would dodge --max-restarts); then the index.
  """
  failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
  if not failed:
    return None

  def rank(i: int) -> tuple:
    rc = codes[i]
    t = exit_times[i] if exit_times is not None and exit_times[i] is not None else math.inf
    killed = rc < 0 and -rc != signal.SIGABRT
    reacted = i in reactions or rc == -signal.SIGABRT
    return (not killed, reacted, t if exit_times is not None else 0.0, rc == PREEMPTED_EXIT, i)

  return min(failed, key=rank)


def settled_failure(codes: Sequence[int | None], stopped: Collection[int],
                    exit_times: Sequence[float | None] | None,
                    findings: "Findings") -> int | None:
  """`first_failure` without the hosts the launcher itself stopped (`stopped`, ending by its
  SIGTERM or SIGKILL); one that left with its own code during the grace still counts.
  """
  own = [None if i in stopped and rc in (-signal.SIGTERM, -signal.SIGKILL) else rc
         for i, rc in enumerate(codes)]
  return first_failure(own, exit_times, findings.reactions)


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds --max-restarts and --max-preemptions, as every launcher spells them."""
  parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                      help="restart all hosts up to K times after a host fails (default 0)")
  parser.add_argument("--max-preemptions", type=int, default=None, metavar="P",
                      help=f"restart all hosts up to P times after a preemption (a host exits "
                           f"{PREEMPTED_EXIT}), not counted in --max-restarts (default "
                           f"{DEFAULT_MAX_PREEMPTIONS} with --max-restarts, else 0: exit "
                           f"{PREEMPTED_EXIT} for an outer scheduler)")


def check_restarts(max_restarts: int, max_preemptions: int | None) -> None:
  """Raises ValueError on a restart budget that is not a count."""
  if not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}.")
  if max_preemptions is not None and (not isinstance(max_preemptions, int) or max_preemptions < 0):
    raise ValueError(f"--max-preemptions must be an integer >= 0, got {max_preemptions!r}.")


def supervise(attempt: Callable[[int], Outcome], *, max_restarts: int = 0,
              max_preemptions: int | None = None) -> int:
  """Runs `attempt(restarts so far)` until the hosts succeed or a budget is spent.

  Two budgets, because a preemption is not a failure: `max_preemptions`
  defaults to DEFAULT_MAX_PREEMPTIONS with `max_restarts > 0`, else 0, so a
  plain preempted run exits PREEMPTED_EXIT for an outer scheduler to requeue.
  Returns 0, else the last attempt's `Outcome.exit_code`.
  """
  check_restarts(max_restarts, max_preemptions)
  if max_preemptions is None:
    max_preemptions = DEFAULT_MAX_PREEMPTIONS if max_restarts > 0 else 0
  restarts = preemptions = 0
  while True:
    outcome = attempt(restarts + preemptions)
    if outcome.ok:
      if restarts + preemptions:
        done = [_plural(n, noun) for n, noun in ((restarts, "restart"),
                                                  (preemptions, "preemption restart")) if n]
        note(f"all hosts exited 0 after {' and '.join(done)}.")
      return 0
    note(describe(outcome))
    code = outcome.exit_code()
    if outcome.signal is not None or outcome.timed_out or outcome.stopped_by_user:
      return code  # A user's stop, our own stop or a deadline: never restarted.
    what = failure(outcome)
    if outcome.write_failed:
      if max_restarts:
        note(f"not restarting (--max-restarts {max_restarts}): a restart would fail at the same "
             f"save; make room as the host's message says, then run the same command again "
             f"(it resumes from the last good checkpoint); exiting {code}.")
      return code
    if outcome.preempted:
      if preemptions >= max_preemptions:
        if max_preemptions:
          note(f"giving up after {_plural(preemptions, 'preemption restart')} "
               f"(--max-preemptions {max_preemptions}); last: {what}; exiting {code}.")
        else:
          note(f"exiting {code} (preempted) so that an outer scheduler can requeue the job; "
               "--max-preemptions N restarts it here instead.")
        return code
      preemptions += 1
      note(f"preemption restart {preemptions}/{max_preemptions} after {what}")
    else:
      if restarts >= max_restarts:
        if max_restarts:
          note(f"giving up after {_plural(restarts, 'restart')} (--max-restarts {max_restarts}); "
               f"last failure: {what}; exiting {code}.")
        return code
      restarts += 1
      note(f"restart {restarts}/{max_restarts} after {what}")


def _plural(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def note(message: str) -> None:
  """Prints a `[launcher] ` line to stderr, where the launchers say what they decide."""
  print(f"[launcher] {message}", file=sys.stderr, flush=True)


def failure(outcome: Outcome) -> str:
  """One phrase for what ended the hosts, e.g. `host 1 failed with signal SIGKILL`."""
  n = len(outcome.returncodes)
  if outcome.signal == signal.SIGINT:
    return "stopped by the user (Ctrl-C, SIGINT)"
  if outcome.signal is not None:
    return f"received {_signal_name(outcome.signal)}"
  if outcome.timed_out:
    return "timed out"
  if outcome.failed_host is None:
    return f"all {n} hosts exited 0"
  i = outcome.failed_host
  rc = outcome.returncodes[i] or 0
  if outcome.service_stopped is not None:
    ends = ", ".join(f"host {h} {_end(c)}" for h, c in enumerate(outcome.returncodes))
    return (f"the coordination service stopped: {_end(outcome.service_stopped)} (the launcher "
            f"ran it beside the hosts; JAX then ended every host: {ends})")
  if outcome.unresponsive:
    who = _hosts(outcome.unresponsive)
    return (f"{who} stopped responding: frozen, or its machine is unreachable (the coordination "
            f"service got no heartbeat from it for the heartbeat timeout, HETJAX_HEARTBEAT_TIMEOUT; "
            f"host {i} then ended with {_end(rc)} because of it)")
  if rc == STALLED_EXIT:
    who = (f"{_hosts(outcome.stalled)} stopped making progress" if outcome.stalled else
           "every host waited in the same reduction")
    return (f"{who}: the step watchdog stopped the job (exit code {rc}; each live host's log "
            "holds its threads' stacks)")
  if rc == PREEMPTED_EXIT:
    return f"host {i} was preempted (exit code {rc})"
  if rc == WRITE_FAILED_EXIT:
    return (f"{_hosts(outcome.blamed())} could not write a checkpoint (exit code {rc}: a full or "
            "unwritable disk, or an unreachable bucket)")
  if outcome.stopped_by_user:
    return f"host {i} was stopped by the user ({_end(rc)})"
  return f"host {i} failed with {_end(rc)}"


def describe(outcome: Outcome) -> str:
  """A human summary of a failed `Outcome`: who failed, how, and the last lines."""
  n = len(outcome.returncodes)
  if outcome.signal is not None:
    ends = ", ".join(f"host {i} {_end(rc)}" for i, rc in enumerate(outcome.returncodes))
    return f"{failure(outcome)}; all {n} hosts stopped ({ends})."
  if outcome.timed_out:
    return f"{failure(outcome)}; stopped all {n} hosts."
  if outcome.failed_host is None:
    return f"{failure(outcome)}."
  others = ("" if outcome.service_stopped is not None else
            {1: "", 2: "; stopped the other host"}.get(n, f"; stopped the other {n - 1} hosts"))
  text = f"{failure(outcome)}{others}."
  if outcome.preempted or outcome.stopped_by_user or outcome.service_stopped is not None:
    return text  # It saved and asked for a restart, or no host is to blame: no tail to show.
  i = outcome.blamed()[0]  # The last lines of the host that held the job up, if named.
  lines = outcome.tails[i] if outcome.tails else []
  if lines:
    text += f"\nLast {len(lines)} output lines of host {i}:\n" + "\n".join(
        f"  {line}" for line in lines)
  else:
    text += f"\nhost {i} printed nothing."
  return text


def _end(rc: int | None) -> str:
  if rc is None:
    return "still running"
  return f"exit code {rc}" if rc >= 0 else f"signal {_signal_name(-rc)}"


def _hosts(hosts: Sequence[int]) -> str:
  return "host " + str(hosts[0]) if len(hosts) == 1 else "hosts " + ", ".join(map(str, hosts))


def _signal_name(signum: int) -> str:
  try:
    return signal.Signals(signum).name
  except ValueError:
    return str(signum)


# What JAX's coordination service logs, on every host, when hosts stop
# sending heartbeats; the hosts' numbers follow, one per line (JAX 0.10 to 0.12:
# `1`; older releases: `/job:jax_worker/replica:0/task:1`).
_HEARTBEATS = "stopped sending heartbeats"
_TASK = re.compile(r"^\s*(?:/job:[^/\s]+/replica:\d+/task:)?(\d+)\s*$")


class Findings:
  """Who held the job up, in the hosts' own lines as they pass: not the tails, where a JAX
  abort's C++ stack pushes out the line naming the dead host.
  """

  def __init__(self):
    self.unresponsive: set[int] = set()  # Reported by the coordination service.
    self.stalled: set[int] = set()  # Named by a host's step watchdog.
    self.write_failed: set[int] = set()  # Named by every host when one's checkpoint write failed.
    self.reactions: set[int] = set()  # Hosts that failed because a peer was gone.
    self._listing: set[int] = set()  # Hosts whose next lines list unhealthy tasks.

  def scan(self, host: int, line: str) -> None:
    if host in self._listing:
      found = _TASK.match(line)
      if found:
        self.unresponsive.add(int(found.group(1)))
        return
      self._listing.discard(host)
    if _HEARTBEATS in line and line.rstrip().endswith(":"):
      self._listing.add(host)
    elif line.startswith(watchdog.MARKER):
      self.stalled.update(_named(line[len(watchdog.MARKER):]))
    elif line.startswith(ending.MARKERS[WRITE_FAILED_EXIT]):
      self.write_failed.update(_named(line[len(ending.MARKERS[WRITE_FAILED_EXIT]):]))
    elif line.startswith(lost_peer.MARKER):
      self.reactions.add(host)


def _named(hosts: str) -> list[int]:
  return [int(h) for h in hosts.strip().split(",") if h.strip().isdigit()]
