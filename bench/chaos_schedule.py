"""The chaos soak's schedule and the words it reads: pure, stdlib only (bench/chaos.py runs them).

A schedule is drawn from a seed: N faults, one every `gap` steps of one long
run, every kind at least once before any repeats (as far as N allows), the
victim of each drawn too. What each fault should end in, and who should be
named, is decided here, so that the bench and its test agree on it.
"""

from __future__ import annotations

import dataclasses
import random
import re

# Sent by the bench from outside the hosts.
KILL = "kill-9"                 # SIGKILL of one host (host 0 too)
TERM_ONE = "sigterm-one"        # SIGTERM to one host: a preemption notice
TERM_ALL = "sigterm-all"        # SIGTERM to every host at once
STOP = "sigstop"                # SIGSTOP: a frozen host (host 0 too), which must be named
DAMAGE = "damaged-checkpoint"   # the newest committed checkpoint truncated, then kill -9 of a host
# EMULATED inside a host (HETJAX_FAULTS, hetjax.cluster.emulate), each once per job.
STALL_STEP = "stall-in-step"
STALL_EVAL = "stall-in-evaluation"
FAIL_WRITE = "fail-write"
KINDS = (KILL, TERM_ONE, TERM_ALL, STOP, STALL_STEP, STALL_EVAL, DAMAGE, FAIL_WRITE)
INSIDE = (STALL_STEP, STALL_EVAL, FAIL_WRITE)

# How each kind ends an attempt: the launcher restarts it (a failure, under
# --max-restarts), restarts it as a preemption (exit 75, under
# --max-preemptions), or the job ends with 74 (a write that failed would fail
# again: the launcher never restarts it) and the bench resumes it by hand, as
# an operator would once the disk has room.
ENDS = {KILL: "restart", DAMAGE: "restart", STOP: "restart", STALL_STEP: "restart",
        STALL_EVAL: "restart", TERM_ONE: "preemption", TERM_ALL: "preemption",
        FAIL_WRITE: "exit 74"}


@dataclasses.dataclass(frozen=True)
class Fault:
  """One fault of the schedule: `kind` hits host `host` (None: every host) at step `step`."""

  kind: str
  host: int | None
  step: int

  @property
  def expected(self) -> set[int]:
    """The hosts the job's lines must name for this fault."""
    return {0, 1} if self.host is None else {self.host}

  def env_item(self) -> str | None:
    """This fault as a HETJAX_FAULTS item (None: the bench sends it from outside)."""
    return f"{self.host}:{self.kind}@{self.step}" if self.kind in INSIDE else None

  def __str__(self) -> str:
    who = "every host" if self.host is None else f"host {self.host}"
    return f"{self.kind} of {who} at step {self.step}"


AFTER_FAILED_WRITE = 3  # gaps before the fault that follows a failed write


def draw(faults: int, seed: int, *, hosts: int = 2, first: int = 20, gap: int = 20
         ) -> list[Fault]:
  """`faults` faults from `seed`, one every `gap` steps from step `first` (a checkpoint step;
  three gaps after a failed write).

  Every kind comes once (shuffled) before any comes again. The first kill -9
  and the first SIGSTOP hit host 0 (the launcher runs the coordination
  service apart from it, so a frozen host 0 is named as any host is); a
  later SIGSTOP hits another host, drawn as before.
  """
  if faults < 0 or hosts < 2:
    raise ValueError(f"a soak needs faults >= 0 and hosts >= 2; got {faults} and {hosts}.")
  # Kinds and victims from two streams: a longer soak extends a shorter one.
  rng, hosts_rng = random.Random(seed), random.Random(f"{seed}/hosts")
  kinds: list[str] = []
  while len(kinds) < faults:
    kinds += rng.sample(KINDS, len(KINDS))
  out, killed_0, stopped_0, step = [], False, False, first
  for kind in kinds[:faults]:
    if kind == TERM_ALL:
      host = None
    elif kind == KILL and not killed_0:
      host, killed_0 = 0, True
    elif kind == STOP:
      host = hosts_rng.randrange(1, hosts)  # Drawn even for host 0: the others' victims stay.
      if not stopped_0:
        host, stopped_0 = 0, True
    else:
      host = hosts_rng.randrange(hosts)
    out.append(Fault(kind, host, step))
    # A write that fails in orbax's background commit surfaces steps later (the hosts vote on
    # it): the next fault must not come before the job has ended and resumed.
    step += gap * (AFTER_FAILED_WRITE if kind == FAIL_WRITE else 1)
  return out


def faults_env(schedule: list[Fault]) -> str:
  """The HETJAX_FAULTS value for the faults emulated inside the hosts."""
  return ",".join(item for f in schedule if (item := f.env_item()))


# ---- what the job's lines say ----------------------------------------------------

STEP = re.compile(r"^\[host 0\] step\s+(\d+)/")
RESUMED = re.compile(r"^\[host 0\] hetjax: resumed from \S*?/(\d+) ")
RESUMED_OR_STEP = re.compile(RESUMED.pattern + r"|^\[host 0\] step\s+\d+/")
ENDED = re.compile(r"^\[launcher\] (preemption restart|restart) \d+/\d+ after (.*)$")
WRITE_FAILED = re.compile(r"^\[launcher\] host (\d+) could not write a checkpoint")
REACHED = re.compile(r"^\[host (\d+)\] hetjax train: preempted\b.*reached this host during step")
EMULATED = re.compile(r"^\[host (\d+)\] hetjax: emulated fault: host (\d+)")


def named_hosts(text: str) -> set[int]:
  """The hosts a launcher line names: `host 1 ...`, `hosts 0, 1 ...`."""
  found = set()
  for m in re.finditer(r"\bhosts? ((?:\d+(?:, | and )?)+)", text):
    found |= {int(h) for h in re.findall(r"\d+", m.group(1))}
  return found


def blamed(text: str) -> set[int]:
  """The host(s) a launcher restart line blames: the first sentence, before any `then`."""
  return named_hosts(re.split(r"[;:(]| then ", text, maxsplit=1)[0])
