"""Ending a job together: one host's verdict reaches every host, and they all leave with its code.

The others are usually stuck where no error reaches them (a collective,
orbax's barrier), so the deciding host posts its verdict to the key-value
store, which every watchdog thread reads each poll; each host says what it
knows, acknowledges, and exits once every live host has (or `ACK_WAIT_S`).
Host 0 leaves last: where it runs the service, JAX aborts a host whose
service vanished before it can say a word. Stdlib only.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from typing import Callable

from hetjax.cluster import positions
from hetjax.cluster.positions import Position, behind, message
from hetjax.exits import STALLED_EXIT, WRITE_FAILED_EXIT

_ENDS = "hetjax/end/"      # host -> "CODE REASON": a host's verdict.
_ACKS = "hetjax/ended/"    # host -> "1": this host has said its piece and is leaving.
ACK_WAIT_S = 10.0          # The longest a host waits for the others' acknowledgements.
HOST_0_LAST_S = 1.0        # Host 0's extra wait, so that the others leave before its service.
# The cause first: a stall that follows a failed write is the write's consequence.
PRIORITY = (WRITE_FAILED_EXIT, STALLED_EXIT)
# The line naming the host behind a non-stall verdict, for the launchers (`supervise`).
MARKERS = {WRITE_FAILED_EXIT: "[hetjax] checkpoint write failed on host:"}
STALL_MARKER = "[hetjax] watchdog: stalled host(s):"  # The watchdog's, naming the stalled hosts.


def post(client, host_id: int, code: int, reason: str) -> None:
  """Posts this host's verdict (`reason` is one line)."""
  _set(client, _ENDS + str(host_id), f"{code} {' '.join(reason.split())}")


def verdicts(client) -> dict[int, tuple[int, str]]:
  """Every posted verdict, {host: (code, reason)}; empty when none or unreachable."""
  return {h: (int(v.split(" ", 1)[0]), v.split(" ", 1)[1] if " " in v else "")
          for h, v in _dir(client, _ENDS).items()}


def first(found: dict[int, tuple[int, str]]) -> tuple[int, int, str]:
  """(host, code, reason) of the verdict that decides: the cause's code first, then the lowest host."""
  rank = lambda h: (PRIORITY.index(found[h][0]) if found[h][0] in PRIORITY else len(PRIORITY), h)
  host = min(found, key=rank)
  return host, found[host][0], found[host][1]


def acknowledge(client, host_id: int) -> None:
  _set(client, _ACKS + str(host_id), "1")


def wait_for_acknowledgements(client, host_id: int, num_hosts: int, skip: set[int],
                              sleep: Callable[[float], None] = time.sleep,
                              clock: Callable[[], float] = time.monotonic) -> None:
  """Returns once every host but `skip` (frozen, gone) acknowledged, or after ACK_WAIT_S."""
  deadline = clock() + ACK_WAIT_S
  wanted = set(range(num_hosts)) - skip - {host_id}
  while clock() < deadline and not wanted <= set(_dir(client, _ACKS)):
    sleep(0.05)
  if host_id == 0:
    sleep(HOST_0_LAST_S)


def _set(client, key: str, value: str) -> None:
  try:
    client.key_value_set(key, value, allow_overwrite=True)
  except Exception:  # The service is going away: nobody left to tell.
    pass


def _dir(client, prefix: str) -> dict[int, str]:
  try:
    entries = client.key_value_dir_get(prefix)
  except Exception:  # Unreachable, or nothing posted.
    return {}
  return {int(k.rsplit("/", 1)[1]): v for k, v in entries}


def say_stall(host_id: int, num_hosts: int, client, mine: Position | None, idle: float,
              limit: str, unit: str, by: int, post: Callable[[], None],
              poll_s: float) -> list[int]:
  """A stall's words on this host: its stacks, every host's place, the hosts behind and
  `STALL_MARKER`; then, a few polls later, the frozen hosts (returned) if any."""
  why = "" if by == host_id else f" (host {by} stopped first)"
  print(f"hetjax: watchdog: host {host_id}: no progress for {idle:.1f} s{why}; the stacks of "
        "this host's threads follow.", file=sys.stderr, flush=True)
  faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
  first = {host_id: mine} if client is None else {**positions.read_all(client, num_hosts),
                                                  host_id: mine}
  # Said at once: the first host to exit may end the others (JAX aborts a
  # host whose coordinator or peer is gone), so a later line may never be written.
  _say(message(idle, limit, first, behind(first), (), unit), behind(first))
  if client is None:
    return []
  # Every live host posts each poll: one whose beat does not move over
  # three polls is frozen (SIGSTOP, a machine that stopped answering).
  for _ in range(3):
    time.sleep(poll_s)
    post()
  later = {**positions.read_all(client, num_hosts), host_id: mine}
  frozen = [h for h in range(num_hosts) if h != host_id and later.get(h) is not None
            and first.get(h) is not None and later[h].beat == first[h].beat]
  if frozen:
    stuck = behind(later, frozen)
    _say(message(idle, limit, later, stuck, frozen, unit), stuck)
  return frozen


def _say(text: str, stuck) -> None:
  print(text, file=sys.stderr, flush=True)
  print(f"{STALL_MARKER} {','.join(map(str, stuck)) or 'none'}", file=sys.stderr, flush=True)
