"""The step watchdog: a stuck job is stopped, and the host that did not keep up is named.

A host stuck inside its step (a hung file read, a stuck data worker, a GPU
hang) stalls every other host in the next cross-host reduction, silently
and for ever: no error is raised anywhere. So every host keeps, in a thread
of its own, the time of the job's last progress (a step entered, its
reduction joined, a step completed). When a step has been outstanding for
longer than the limit, every host that is still alive
  1. dumps its threads' stacks to its log (`faulthandler`), which shows
     where a live host waits (the collective) and where a stuck one is stuck;
  2. reads where every host is: each host's thread posts its position (the
     last step it entered, and whether it joined that step's reduction) to
     the cluster's key-value store, which the coordination service answers
     while the collective is stuck; a host whose posts stopped is frozen;
  3. names the hosts behind the furthest one, prints a line the launchers
     read (`MARKER`), and exits with `STALLED_EXIT`, which the launchers
     restart from the last checkpoint under `--max-restarts`.

The limit: `TrainConfig.watchdog_s` (`hetjax train --watchdog S`); by
default the larger of `STEP_FACTOR` x the median step and `MIN_DEFAULT_S`
(a slow but moving job is never stopped). It is armed only after
`WARMUP_STEPS` completed steps of this run (compiling and the first steps,
which may be slow for good reasons, never count), and only while a step is
outstanding: evaluation, checkpoints and the summary between steps are not
steps. A round of the rounds modes is one "step" here.

Host 0 also reads every host's posts while it watches: a host whose posts
stop for a third of the heartbeat timeout (HETJAX_HEARTBEAT_TIMEOUT) is named
in host 0's log as frozen or unreachable, before the coordination service
declares it dead and JAX aborts host 0 (which prints only JAX's own words).

Stdlib at import; JAX's key-value client is looked up when the watchdog
starts, and a single-host run (no client) still stops and dumps its stacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import statistics
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Sequence

from hetjax.config import Env
from hetjax.exits import STALLED_EXIT

STEP_FACTOR = 20
MIN_DEFAULT_S = 300.0
WARMUP_STEPS = 3
# The line every stopping host prints, for the launchers (`hetjax.cluster.supervise`).
MARKER = "[hetjax] watchdog: stalled host(s):"
_DIR = "hetjax/watchdog/"
_KEY = _DIR + "{host}"
DEFAULT_HEARTBEAT_S = 100  # JAX's; hetjax.cluster.runtime passes HETJAX_HEARTBEAT_TIMEOUT on.
_RECENT = 50  # Step times the default limit is computed from.

ENTERED, REDUCING = 0, 1


@dataclasses.dataclass(frozen=True)
class Position:
  """Where a host is: the last step it entered, and whether it joined that step's reduction."""

  step: int
  phase: int
  beat: int = 0  # Counts the host's posts: a beat that stops moving means a frozen host.

  def encode(self) -> str:
    return f"{self.step} {self.phase} {self.beat}"

  @classmethod
  def decode(cls, text: str) -> "Position":
    step, phase, beat = (int(x) for x in text.split())
    return cls(step, phase, beat)

  def describe(self) -> str:
    where = "waiting in its reduction" if self.phase == REDUCING else "inside it, before its reduction"
    return f"entered step {self.step}, {where}"


def behind(positions: Mapping[int, Position | None], frozen: Sequence[int] = ()) -> list[int]:
  """The hosts that held the job up: frozen, never posted, or behind the furthest host.

  When every live host stands at the same place, nobody is behind: all wait
  in one collective (a device, network or collective-library hang), and the
  answer is the empty list.
  """
  silent = sorted(set(frozen) | {h for h, p in positions.items() if p is None})
  known = {h: (p.step, p.phase) for h, p in positions.items() if p is not None and h not in silent}
  if not known:
    return silent
  front = max(known.values())
  return sorted(set(silent) | {h for h, at in known.items() if at < front})


def message(idle_s: float, limit_s: float, positions: Mapping[int, Position | None],
            stuck: Sequence[int], frozen: Sequence[int]) -> str:
  """What a stopping host prints: the wait, every host's place, the culprits, the fix."""
  places = []
  for h in sorted(positions):
    p = positions[h]
    if h in frozen:
      places.append(f"host {h}: stopped posting (frozen, or its machine is unreachable)")
    elif p is None:
      places.append(f"host {h}: never posted a position")
    else:
      places.append(f"host {h}: {p.describe()}")
  if stuck:
    who = (f"host(s) {', '.join(map(str, stuck))} did not keep up with the others")
  else:
    who = ("no host is behind: every host waits in the same reduction (a device, network or "
           "collective-library hang)")
  return (f"hetjax: watchdog: no step completed for {idle_s:.1f} s (limit {limit_s:g} s): {who}. "
          f"{'; '.join(places)}. This host's thread stacks are above. Exiting with code "
          f"{STALLED_EXIT}: under --max-restarts the launcher restarts the job from its last "
          "checkpoint; raise the limit with --watchdog SECONDS if steps are this slow.")


class Watchdog:
  """One per process (`WATCHDOG`); the trainers report progress, a thread watches it.

  The trainers call `entered(step)` when they start a step, `reducing(step)`
  when they join its reduction and `completed(step)` when its results are
  back; each is a few attribute writes, so the step loop stays lean.
  """

  def __init__(self, *, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._quit = threading.Event()
    self._reset(None)

  def _reset(self, limit_s: float | None) -> None:
    self.limit_s = limit_s
    self.position: Position | None = None
    self._outstanding = 0
    self._completed = 0
    self._last_progress = self._clock()
    self._last_done: float | None = None
    self._step_s: list[float] = []

  # ---- what the trainers call --------------------------------------------------

  def entered(self, step: int) -> None:
    with self._lock:
      self.position = Position(step, ENTERED)
      self._outstanding += 1
      self._last_progress = self._clock()

  def reducing(self, step: int) -> None:
    with self._lock:
      self.position = Position(step, REDUCING)
      self._last_progress = self._clock()

  def completed(self, step: int) -> None:
    del step
    with self._lock:
      now = self._clock()
      self._outstanding = max(0, self._outstanding - 1)
      self._completed += 1
      if self._last_done is not None and self._completed > WARMUP_STEPS:
        self._step_s = [*self._step_s[-_RECENT + 1:], now - self._last_done]
      self._last_done = self._last_progress = now

  # ---- the decision ------------------------------------------------------------------

  def current_limit(self) -> float | None:
    """The limit in force now: None while not armed (warming up, or switched off)."""
    if self.limit_s == 0 or self._completed < WARMUP_STEPS:
      return None
    if self.limit_s is not None:
      return self.limit_s
    if not self._step_s:
      return None
    return max(STEP_FACTOR * statistics.median(self._step_s), MIN_DEFAULT_S)

  def stalled_for(self) -> float | None:
    """Seconds a step has been outstanding past the limit's start, when over the limit."""
    with self._lock:
      limit = self.current_limit()
      if limit is None or not self._outstanding:
        return None
      idle = self._clock() - self._last_progress
    return idle if idle > limit else None

  # ---- the thread --------------------------------------------------------------------

  @contextlib.contextmanager
  def watching(self, limit_s: float | None, host_id: int, num_hosts: int) -> Iterator["Watchdog"]:
    """Watches the steps inside the block (nested blocks share the outer watch).

    Args:
      limit_s: seconds; None: the default from the measured step time; 0: off.
      host_id, num_hosts: this host's place, to name the others.
    """
    if self._thread is not None or limit_s == 0:
      yield self
      return
    self._reset(limit_s)
    self._quit.clear()
    client = _kv_client() if num_hosts > 1 else None
    self._thread = threading.Thread(target=self._run, args=(host_id, num_hosts, client),
                                    name="hetjax-watchdog", daemon=True)
    self._thread.start()
    try:
      yield self
    finally:
      self._quit.set()
      self._thread.join()
      self._thread = None

  def _poll_s(self) -> float:
    limit = self.current_limit() or self.limit_s or MIN_DEFAULT_S
    return min(1.0, max(0.05, limit / 10))

  def _run(self, host_id: int, num_hosts: int, client) -> None:
    beat, posted = 0, None
    peers = _Peers(_heartbeat_s()) if client is not None and host_id == 0 else None
    while not self._quit.wait(self._poll_s()):
      with self._lock:
        position = self.position
      if client is not None and position is not None:
        beat += 1
        posted = dataclasses.replace(position, beat=beat)
        _post(client, host_id, posted)
      if peers is not None and self._completed >= WARMUP_STEPS:  # Compiling may hold the GIL.
        peers.check(client, self._clock(), skip=host_id)
      idle = self.stalled_for()
      if idle is not None:
        self._stop(idle, host_id, num_hosts, client, posted)

  def _stop(self, idle: float, host_id: int, num_hosts: int, client, mine: Position | None) -> None:
    """Dumps the stacks, names the hosts behind, exits STALLED_EXIT (never returns)."""
    print(f"hetjax: watchdog: host {host_id}: no step completed for {idle:.1f} s; the stacks of "
          "this host's threads follow.", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    limit = self.current_limit() or 0.0
    first = {host_id: mine} if client is None else {**_read_all(client, num_hosts), host_id: mine}
    # Said at once: the first host to exit ends the others (JAX aborts a host
    # whose coordinator or peer is gone), so a later line may never be written.
    _say(message(idle, limit, first, behind(first), ()), behind(first))
    if client is not None:
      # Every live host posts each poll: one whose beat does not move over
      # three polls is frozen (SIGSTOP, a machine that stopped answering).
      time.sleep(3 * self._poll_s())
      later = {**_read_all(client, num_hosts), host_id: mine}
      frozen = [h for h in range(num_hosts) if h != host_id and later.get(h) is not None
                and first.get(h) is not None and later[h].beat == first[h].beat]
      if frozen:
        _say(message(idle, limit, later, behind(later, frozen), frozen), behind(later, frozen))
    os._exit(STALLED_EXIT)


def _say(text: str, stuck: Sequence[int]) -> None:
  print(text, file=sys.stderr, flush=True)
  print(f"{MARKER} {','.join(map(str, stuck)) or 'none'}", file=sys.stderr, flush=True)


def _kv_client():
  """JAX's coordination-service client, or None outside a multi-host runtime."""
  try:
    from jax._src import distributed  # No public key-value API in JAX 0.10.
  except ImportError:
    return None
  return distributed.global_state.client


def _post(client, host_id: int, position: Position) -> None:
  try:
    client.key_value_set(_KEY.format(host=host_id), position.encode(), allow_overwrite=True)
  except Exception:  # The service is going away (shutdown, a peer's abort): nothing to post to.
    pass


def _read_all(client, num_hosts: int) -> dict[int, Position | None]:
  """Every host's last posted position (None for a host that never posted); non-blocking."""
  out: dict[int, Position | None] = {}
  for h in range(num_hosts):
    try:
      out[h] = Position.decode(client.key_value_try_get(_KEY.format(host=h)))
    except Exception:  # Not found (never posted) or the service is unreachable.
      out[h] = None
  return out


class _Peers:
  """Host 0's view of the other hosts' posts: it names a host whose posts stopped."""

  def __init__(self, heartbeat_s: float):
    self.heartbeat_s = heartbeat_s
    self._seen: dict[int, tuple[int, float]] = {}  # host -> (beat, when it last moved)
    self._named: set[int] = set()

  def check(self, client, now: float, skip: int) -> None:
    try:
      entries = client.key_value_dir_get(_DIR)  # One call, whatever the number of hosts.
    except Exception:  # The service is going away: JAX speaks for itself then.
      return
    for key, value in entries:
      host, beat = int(key.rsplit("/", 1)[1]), Position.decode(value).beat
      if host == skip:
        continue
      last = self._seen.get(host)
      if last is None or last[0] != beat:
        self._seen[host] = (beat, now)
      elif now - last[1] > self.heartbeat_s / 3 and host not in self._named:
        self._named.add(host)
        print(f"hetjax: host {host} stopped responding: frozen, or its machine is unreachable "
              f"(no sign of life for {now - last[1]:.0f} s; the coordination service declares "
              f"it dead after {Env.HEARTBEAT_TIMEOUT}={self.heartbeat_s:g} s, and JAX then "
              "aborts the other hosts).", file=sys.stderr, flush=True)


def _heartbeat_s() -> float:
  raw = os.environ.get(Env.HEARTBEAT_TIMEOUT)
  try:
    return float(raw) if raw else DEFAULT_HEARTBEAT_S
  except ValueError:  # runtime.initialize refused it already.
    return DEFAULT_HEARTBEAT_S


WATCHDOG = Watchdog()


def entered(step: int) -> None:
  WATCHDOG.entered(step)


def reducing(step: int) -> None:
  WATCHDOG.reducing(step)


def completed(step: int) -> None:
  WATCHDOG.completed(step)


def watching(limit_s: float | None, host_id: int, num_hosts: int):
  """`WATCHDOG.watching`: what `fit` wraps its loop in."""
  return WATCHDOG.watching(limit_s, host_id, num_hosts)
