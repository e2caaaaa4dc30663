"""Where each host is in its run, and who held the others up: what the watchdog posts and reads.

Each host's watchdog thread posts its `Position` to the key-value store (the
service answers while a collective is stuck). Every host passes the same
phase boundaries in the same order (invariant 3), so `(seq, step, waiting)`
orders the hosts along the one path they all walk. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

from hetjax.exits import STALLED_EXIT

KEY = "hetjax/watchdog/{host}"  # Each host's posted position in the key-value store.
_BEFORE_STEPS = ("joining", "building", "restoring")  # Phases with no step to name.


@dataclasses.dataclass(frozen=True)
class Position:
  """Where a host is: `seq` phase boundaries passed, the step (or the phase's), `waiting` in a
  cross-host wait, `since` its last progress (time.time()), `beat` its posts (stuck: frozen).
  """

  seq: int
  step: int
  waiting: bool
  phase: str = "training"
  since: float = 0.0
  beat: int = 0

  def encode(self) -> str:
    return f"{self.seq} {self.step} {int(self.waiting)} {self.beat} {self.since:.3f} {self.phase}"

  @classmethod
  def decode(cls, text: str) -> "Position":
    seq, step, waiting, beat, since, phase = text.split()
    return cls(int(seq), int(step), waiting == "1", phase, float(since), int(beat))

  @property
  def order(self) -> tuple[int, int, bool]:
    """How far along the hosts' common path this host is."""
    return (self.seq, self.step, self.waiting)

  def describe(self, unit: str = "step", now: float | None = None) -> str:
    """E.g. `in evaluation at step 4 for 612 s`, `inside round 20, before its reduction, for 12 s`."""
    held = "" if not self.since else f" for {max(0.0, (now or time.time()) - self.since):.0f} s"
    if self.phase == "training":
      where = "waiting in its reduction" if self.waiting else "before its reduction"
      return f"inside {unit} {self.step}, {where},{held}".rstrip(",")
    wait = ", waiting for the other hosts," if self.waiting else ""
    at = "" if self.phase in _BEFORE_STEPS else f" at {unit} {self.step}"
    return f"in {self.phase}{at}{wait}{held}".rstrip(",")


def behind(positions: Mapping[int, Position | None], frozen: Sequence[int] = ()) -> list[int]:
  """The hosts that held the job up: frozen, never posted, or behind the furthest host; none
  when all stand at the same place (one hang in a device, network or shared file system).
  """
  silent = sorted(set(frozen) | {h for h, p in positions.items() if p is None})
  known = {h: p.order for h, p in positions.items() if p is not None and h not in silent}
  if not known:
    return silent
  front = max(known.values())
  return sorted(set(silent) | {h for h, at in known.items() if at < front})


def places(positions: Mapping[int, Position | None], frozen: Sequence[int] = (),
           unit: str = "step", now: float | None = None) -> str:
  """`host 0: ...; host 1: ...`: every host's place, as a stopping host prints it."""
  out = []
  for h in sorted(positions):
    p = positions[h]
    if h in frozen:
      out.append(f"host {h}: stopped posting (frozen, or its machine is unreachable)")
    elif p is None:
      out.append(f"host {h}: never posted a position")
    else:
      out.append(f"host {h}: {p.describe(unit, now)}")
  return "; ".join(out)


def message(idle_s: float, limit: str, positions: Mapping[int, Position | None],
            stuck: Sequence[int], frozen: Sequence[int], unit: str = "step",
            now: float | None = None) -> str:
  """What a stopping host prints: the wait, every host's place, the culprits, the fix.
  `limit` names its source, e.g. `15 s for evaluation, 3 x --watchdog 5`."""
  if stuck:
    who = f"host(s) {', '.join(map(str, stuck))} did not keep up with the others"
  else:
    who = ("no host is behind: every host waits or works in the same place (a device, network, "
           "collective-library or shared file-system hang)")
  return (f"hetjax: watchdog: no progress for {idle_s:.1f} s (limit {limit}): {who}. "
          f"{places(positions, frozen, unit, now)}. This host's thread stacks are above. Exiting "
          f"with code {STALLED_EXIT}: under --max-restarts the launcher restarts the job from its "
          "last checkpoint; raise the limit with --watchdog SECONDS if this is a slow but healthy "
          "wait.")


def post(client, host_id: int, position: Position) -> None:
  """Posts this host's position (nothing when the service is going away)."""
  try:
    client.key_value_set(KEY.format(host=host_id), position.encode(), allow_overwrite=True)
  except Exception:  # Shutdown, or a peer's abort: nothing to post to.
    pass


def read_all(client, num_hosts: int) -> dict[int, Position | None]:
  """Every host's last posted position (None for a host that never posted); non-blocking."""
  out: dict[int, Position | None] = {}
  for h in range(num_hosts):
    try:
      out[h] = Position.decode(client.key_value_try_get(KEY.format(host=h)))
    except Exception:  # Not found (never posted) or the service is unreachable.
      out[h] = None
  return out
