"""Host 0's view of the other hosts' posts: a host whose posts stopped for a third of the
heartbeat timeout is named before the service declares it dead and JAX aborts the others
with its own words. Stdlib only.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from hetjax.config import Env
from hetjax.cluster.positions import Position

DEFAULT_HEARTBEAT_S = 100  # JAX's; hetjax.cluster.runtime passes HETJAX_HEARTBEAT_TIMEOUT on.
_DIR = "hetjax/watchdog/"


class Peers:
  """Names, once, a host whose posted beat stopped moving."""

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


def heartbeat_s(env: Mapping[str, str] = os.environ) -> int:
  """HETJAX_HEARTBEAT_TIMEOUT (the coordinator's decides); too short kills a host in a long
  pause of its own (a swap storm, a long GC)."""
  raw = env.get(Env.HEARTBEAT_TIMEOUT)
  if not raw:
    return DEFAULT_HEARTBEAT_S
  try:
    value = int(raw)
  except ValueError:
    raise ValueError(f"{Env.HEARTBEAT_TIMEOUT}={raw!r} is not a whole number of seconds.") from None
  if value < 1:
    raise ValueError(f"{Env.HEARTBEAT_TIMEOUT} must be >= 1 second, got {value}.")
  return value
