"""A host whose peer is gone says so in one line; the full traceback goes to a file.

A dead host's peers fail in their shared collective with a long traceback
that names nobody ("Gloo AllGather failed ... Connection closed by peer").
A survivor says instead which host stopped responding, at which step and
phase, and where the traceback is, then `MARKER`, so the launcher blames the
host that died (`supervise`). Stdlib only.
"""

from __future__ import annotations

import os
import re
import threading
import traceback
from typing import Callable

from hetjax.cluster.positions import Position

# Words of the errors a host meets when a peer, or the coordination service, is gone.
PEER_ERRORS = ("gloo", "connection closed by peer", "connection reset by peer", "socket closed",
               "deadline_exceeded", "unavailable", "failed to connect", "broken pipe")
# How an XLA status reads when JAX raises it as a ValueError (reading an array whose
# collective failed does): the status code first, never a setting's wording.
_XLA_STATUS = re.compile(r"(UNKNOWN|UNAVAILABLE|DEADLINE_EXCEEDED|INTERNAL|ABORTED|CANCELLED): ")
MARKER = "[hetjax] lost a peer; this host's failure is a reaction:"
LOG_NAME = "host{host}-error.log"


def is_peer_failure(error: BaseException) -> bool:
  """Whether `error` is what a collective raises when another host is gone."""
  text = f"{type(error).__name__} {error}".lower()
  return any(words in text for words in PEER_ERRORS)


def is_peer_failure_raised_as_value_error(error: ValueError) -> bool:
  """Whether a `ValueError` is a peer's loss that JAX raised as one (an XLA status whose
  words say a peer is gone), not an error of the user's settings."""
  return bool(_XLA_STATUS.match(str(error))) and is_peer_failure(error)


def suspects(host_id: int, num_hosts: int, service_alive: Callable[[], bool]) -> tuple[list[int], str]:
  """(the hosts that stopped responding, how it is known); [] when it cannot be told. An
  unreachable service means host 0 is gone (a launcher's would answer); of two, the other."""
  if host_id != 0 and not _bounded(service_alive, 1.5):
    return [0], " (the coordination service it runs is gone)"
  others = [h for h in range(num_hosts) if h != host_id]
  return (others, "") if len(others) == 1 else ([], "")


def explain(error: BaseException, host_id: int, num_hosts: int, position: Position | None,
            log_dir: str | None, service_alive: Callable[[], bool],
            unit: str = "step") -> tuple[str, str]:
  """(the one line a surviving host prints, the launcher's marker); writes the traceback
  to `log_dir`/host{H}-error.log."""
  hosts, how = suspects(host_id, num_hosts, service_alive)
  who = (f"host {hosts[0]}" if len(hosts) == 1 else "another host") + " stopped responding"
  if position is not None:
    who += (f" at {unit} {position.step}" if position.phase == "training"
            else f" in {position.phase} at {unit} {position.step}")
  first = next((l.strip() for l in str(error).splitlines() if l.strip()), type(error).__name__)
  first = first if len(first) <= 200 else first[:197] + "..."
  path = _write(error, host_id, log_dir)
  kept = f"full traceback in {path}" if path else "no folder to keep the traceback in (--out)"
  line = (f"{who}{how}: this host's collective failed ({first}); {kept}. Under --max-restarts "
          "the launcher restarts the job from its last checkpoint.")
  return line, f"{MARKER} {','.join(map(str, hosts)) or 'unknown'}"


def _write(error: BaseException, host_id: int, log_dir: str | None) -> str | None:
  if not log_dir:
    return None
  path = os.path.join(log_dir, LOG_NAME.format(host=host_id))
  try:
    os.makedirs(log_dir, exist_ok=True)
    with open(path, "w") as f:
      f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
  except OSError:
    return None
  return path


def _bounded(check: Callable[[], bool], timeout_s: float) -> bool:
  """`check()`, or False when it does not answer within `timeout_s` (a dead service may hang)."""
  answer: list[bool] = []
  thread = threading.Thread(target=lambda: answer.append(bool(check())), daemon=True)
  thread.start()
  thread.join(timeout_s)
  return bool(answer and answer[0])
