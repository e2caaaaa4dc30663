"""The run-wide watchdog: every wait has a deadline, and the host that did not keep up is named.

A host stuck anywhere stalls every other in the next cross-host wait, for
ever. So a thread on every host keeps the time of its last progress (a
phase, a step entered, reduced, completed, a cross-host wait) and posts its
position (`positions`). Past the wait's limit (docs/cluster.md, "Deadlines":
L from `--watchdog S`, x STARTUP_FACTOR or x PHASE_FACTOR, none between
steps; one wait without progress, never a slow but moving phase), every
live host dumps its stacks, names the hosts behind, prints `MARKER` and
exits `STALLED_EXIT` (69), all with the first verdict posted (`ending`).
Host 0 also names a host whose posts stop for a third of the heartbeat
timeout (`peers`), before JAX aborts it with only its own words.
Stdlib at import; a single-host run (no client) still stops and dumps stacks.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from typing import Callable, Iterator

from hetjax import phases
from hetjax.cluster import ending, service
from hetjax.cluster.peers import Peers as _Peers, heartbeat_s
from hetjax.cluster import positions
from hetjax.cluster.positions import Position, behind  # noqa: F401 (public names)
from hetjax.exits import STALLED_EXIT, JobExit

STEP_FACTOR = 20
MIN_DEFAULT_S = 300.0
WARMUP_STEPS = 3
STARTUP_FACTOR = 10  # Building, restoring, compiling: generous.
PHASE_FACTOR = 3     # Evaluation, checkpoint, agreement, summary: one unbroken wait each.
STARTUP = (phases.JOINING, phases.BUILDING, phases.RESTORING)
BETWEEN_STEPS = (phases.EVALUATION, phases.CHECKPOINT, phases.AGREEMENT, phases.SUMMARY)
MARKER = ending.STALL_MARKER  # What every stopping host prints, for the launchers.
_RECENT = 50  # Step times the default limit is computed from.


class Watchdog:
  """One per process (`WATCHDOG`): a phase listener; the trainers report steps (a few
  attribute writes each, so the step loop stays lean), a thread watches.
  """

  def __init__(self, *, clock: Callable[[], float] = time.monotonic,
               wall: Callable[[], float] = time.time, exit: Callable[[int], None] = os._exit):
    self._clock, self._wall, self._exit = clock, wall, exit
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._quit = threading.Event()
    self._seq = 0  # Never reset: hosts compare it along their common path.
    self._failure: tuple[int, str] | None = None
    self._client = None
    self.ending = threading.Event()  # Set once this host decided to leave with the job's verdict.
    # Set once this host's run failed in a multi-host job: a stop signal then (the launcher
    # stopping the survivors) must not turn the failure into a preemption.
    self.failing = threading.Event()
    self._reset(None)

  def _reset(self, limit_s: float | None, unit: str = "step") -> None:
    self.limit_s, self.unit = limit_s, unit
    self.position: Position | None = None
    self._phases: list[tuple[str, int | None]] = []
    self._step = 0
    self._waiting = False
    self._outstanding = 0
    self._completed = 0
    self._last_progress = self._clock()
    self._since = self._wall()
    self._last_done: float | None = None
    self._step_s: list[float] = []

  def _moved(self) -> None:
    """Notes progress and the position it leads to (call with the lock held)."""
    self._last_progress, self._since = self._clock(), self._wall()
    name, step = self._phases[-1] if self._phases else (phases.TRAINING, None)
    self.position = Position(self._seq, self._step if step is None or name == phases.TRAINING
                             else step, self._waiting, name, self._since)

  # ---- what the lifecycle (`hetjax.phases`) and the trainers call ------------------

  def phase_started(self, name: str, step: int | None, at: float) -> None:
    del at
    with self._lock:
      self._phases.append((name, step))
      self._seq += 1
      self._waiting = False
      self._moved()

  def phase_ended(self, name: str, step: int | None, at: float, failed: bool) -> None:
    del name, step, at, failed
    with self._lock:
      if self._phases:
        self._phases.pop()
      self._seq += 1
      self._waiting = False
      self._moved()

  def entered(self, step: int) -> None:
    with self._lock:
      self._step, self._waiting = step, False
      self._outstanding += 1
      self._moved()

  def reducing(self, step: int) -> None:
    with self._lock:
      self._step, self._waiting = step, True
      self._moved()

  def completed(self, step: int) -> None:
    del step
    with self._lock:
      now = self._clock()
      self._outstanding = max(0, self._outstanding - 1)
      self._completed += 1
      if self._last_done is not None and self._completed > WARMUP_STEPS:
        self._step_s = [*self._step_s[-_RECENT + 1:], now - self._last_done]
      self._last_done = now
      self._waiting = False
      self._moved()

  def tick(self) -> None:
    """Progress inside a phase (an evaluation batch read): the wait so far was not a stall."""
    self._last_progress = self._clock()

  @contextlib.contextmanager
  def waiting(self) -> Iterator[None]:
    """Marks a cross-host wait outside a step (a vote, a gather): the others are named first."""
    with self._lock:
      before, self._waiting = self._waiting, True
      self._moved()
    try:
      yield
    finally:
      with self._lock:
        self._waiting = before
        self._moved()

  def fail(self, code: int, reason: str) -> bool:
    """Ends every host with `code`, `reason` (one line) said on each; False when not watching
    several hosts (the caller then reports the failure itself)."""
    if self._thread is None or self._client is None:
      return False
    with self._lock:
      self._failure = self._failure or (code, reason)
    return True

  # ---- the decision ------------------------------------------------------------------

  def step_limit(self) -> float | None:
    """L: --watchdog S, else the default from the measured steps (None: switched off)."""
    if self.limit_s == 0:
      return None
    if self.limit_s is not None:
      return self.limit_s
    if not self._step_s:
      return MIN_DEFAULT_S
    return max(STEP_FACTOR * statistics.median(self._step_s), MIN_DEFAULT_S)

  def current_limit(self) -> tuple[float, str] | None:
    """The limit of the wait in force now and what it is, e.g. (15.0, 'evaluation, 3 x ...')."""
    base = self.step_limit()
    if base is None:
      return None
    source = f"--watchdog {self.limit_s:g}" if self.limit_s else f"the step limit {base:g} s"
    phase = self._phases[-1][0] if self._phases else None
    if phase in STARTUP:
      return STARTUP_FACTOR * base, f"{phase}, {STARTUP_FACTOR} x {source}"
    if phase in BETWEEN_STEPS:
      return PHASE_FACTOR * base, f"{phase}, {PHASE_FACTOR} x {source}"
    if not self._outstanding:
      return None  # Between steps: the user's callbacks, not a wait on the others.
    if self._completed < WARMUP_STEPS:
      return STARTUP_FACTOR * base, (f"the first {WARMUP_STEPS} {self.unit}s, "
                                     f"{STARTUP_FACTOR} x {source}")
    return base, f"a {self.unit}, {source}"

  def stalled_for(self) -> tuple[float, str] | None:
    """(seconds without progress, the limit's words), when over the limit."""
    with self._lock:
      limit = self.current_limit()
      idle = self._clock() - self._last_progress
    if limit is None or idle <= limit[0]:
      return None
    return idle, f"{limit[0]:g} s for {limit[1]}"

  # ---- the thread --------------------------------------------------------------------

  @contextlib.contextmanager
  def watching(self, limit_s: float | None, host_id: int, num_hosts: int,
               unit: str = "step", client=None) -> Iterator["Watchdog"]:
    """Watches every phase and step inside the block (nested blocks share the outer watch);
    `limit_s` None: from the measured steps, 0: no stall checks (a failure still ends every
    host); `unit` 'step' or 'round'; `client` default JAX's key-value store on several hosts."""
    if self._thread is not None:
      self.unit = unit  # The outer watch (the trainer's construction) knew no unit yet.
      yield self
      return
    if client is None and num_hosts > 1:
      client = service.client()
    if limit_s == 0 and client is None:
      yield self
      return
    self._reset(limit_s, unit)
    self._client, self._failure = client, None
    self._quit.clear()
    self._thread = threading.Thread(target=self._run, args=(host_id, num_hosts, client),
                                    name="hetjax-watchdog", daemon=True)
    with phases.PHASES.subscribe(self):
      self._thread.start()
      try:
        yield self
      except BaseException as e:
        if client is not None and not isinstance(e, JobExit):
          # A peer that posted a verdict and left fails this host's collective at once: the
          # verdict, read at the next poll, is what this host says (the thread exits then).
          self.failing.set()
          self.ending.wait(2 * self._poll_s())
        raise
      finally:
        self._quit.set()
        self._thread.join()
        self._thread = None

  def _poll_s(self) -> float:
    limit = self.step_limit() or MIN_DEFAULT_S
    return min(1.0, max(0.05, limit / 10))

  def _post(self, client, host_id: int, beat: int) -> Position | None:
    with self._lock:
      position = self.position
    if client is None or position is None:
      return position
    posted = Position(**{**position.__dict__, "beat": beat})
    positions.post(client, host_id, posted)
    return posted

  def _run(self, host_id: int, num_hosts: int, client) -> None:
    beat = 0
    peers = _Peers(heartbeat_s()) if client is not None and host_id == 0 else None
    while not self._quit.wait(self._poll_s()):
      beat += 1
      mine = self._post(client, host_id, beat)
      if client is not None:
        with self._lock:
          failure = self._failure
        if failure is not None:
          ending.post(client, host_id, *failure)
        found = ending.verdicts(client)
        if found:
          self.end(found, host_id, num_hosts, client, mine)
          return
      if peers is not None and self._completed >= WARMUP_STEPS:  # Compiling may hold the GIL.
        peers.check(client, self._clock(), skip=host_id)
      stalled = self.stalled_for()
      if stalled is not None:
        if client is not None:
          ending.post(client, host_id, STALLED_EXIT, f"{stalled[0]:.1f} s over {stalled[1]}")
          found = ending.verdicts(client) or {host_id: (STALLED_EXIT, "")}
        else:
          found = {host_id: (STALLED_EXIT, "")}
        self.end(found, host_id, num_hosts, client, mine, stalled)
        return

  def end(self, found: dict[int, tuple[int, str]], host_id: int, num_hosts: int, client,
          mine: Position | None, stalled: tuple[float, str] | None = None) -> None:
    """Says this host's piece of the job's verdict, waits for the others, exits with its code."""
    self.ending.set()
    by, code, reason = ending.first(found)
    if code != STALLED_EXIT:
      print(f"hetjax: {reason}", file=sys.stderr, flush=True)
      marker = ending.MARKERS.get(code, f"[hetjax] job ended with code {code} by host:")
      print(f"{marker} {by}", file=sys.stderr, flush=True)  # For the launchers (`supervise`).
      skip: set[int] = set()
    else:
      skip = set(self._stop(host_id, num_hosts, client, mine, stalled, by))
    if client is not None:
      ending.acknowledge(client, host_id)
      ending.wait_for_acknowledgements(client, host_id, num_hosts, skip)
    self._exit(code)

  def _stop(self, host_id: int, num_hosts: int, client, mine: Position | None,
            stalled: tuple[float, str] | None, by: int) -> list[int]:
    """Dumps the stacks, names the hosts behind; returns the frozen hosts."""
    with self._lock:
      idle = stalled[0] if stalled else self._clock() - self._last_progress
    now_limit = self.current_limit()
    limit = stalled[1] if stalled else (f"{now_limit[0]:g} s for {now_limit[1]}" if now_limit
                                        else "none in force on this host")
    beat = [mine.beat if mine else 0]

    def post() -> None:  # Still alive: the others must not take this host for frozen.
      beat[0] += 1
      self._post(client, host_id, beat[0])

    return ending.say_stall(host_id, num_hosts, client, mine, idle, limit, self.unit, by, post,
                            self._poll_s())

  def wait_for_the_end(self, grace_s: float = 5.0) -> None:
    """Blocks while the watchdog ends the job (it exits the process), or `grace_s` without a
    verdict: so a main thread failed by a peer's leaving says the verdict, not its echo."""
    if self._thread is None or self._client is None:
      return
    if self.ending.wait(grace_s):
      time.sleep(2 * ending.ACK_WAIT_S + 30)  # The watchdog thread exits the process.


def service_alive() -> bool:
  """Whether the coordination service (in host 0, or beside the hosts) still answers."""
  client = service.client()
  if client is None:
    return False
  try:
    client.key_value_dir_get("hetjax/")
  except Exception:
    return False
  return True


WATCHDOG = Watchdog()
# What the trainers call per step, what a cross-host vote or gather is wrapped in, and what
# the trainer wraps its construction, `fit` and `close` in.
entered, reducing, completed, waiting, watching = (
    WATCHDOG.entered, WATCHDOG.reducing, WATCHDOG.completed, WATCHDOG.waiting, WATCHDOG.watching)
