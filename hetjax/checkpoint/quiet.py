"""orbax's own noise after a failed read or write, dropped: hetjax reports the event once.

A damaged checkpoint that is skipped, or a write that fails, is said in one
line (or one message) by `hetjax.checkpoint.manager`; orbax would add a
traceback per background thread, and tensorstore a stray "Event loop is
closed" per pending array.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

log = logging.getLogger("hetjax.checkpoint")


class _QuietOrbax(logging.Filter):
  """Drops orbax's `logging.exception` tracebacks (one per background thread)."""

  def filter(self, record: logging.LogRecord) -> bool:
    from_orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
    return not (from_orbax and record.exc_info and record.levelno >= logging.WARNING)


_QUIET = _QuietOrbax()


def _from_a_closed_loop(kind: type, error: BaseException, tb: Any) -> bool:
  """A tensorstore callback that woke an asyncio loop orbax had already closed.

  It has no Python caller, so `sys.excepthook` prints it once per pending
  array. Recognised by its traceback starting inside asyncio (no user frame),
  so no other error is hidden.
  """
  if kind is not RuntimeError or str(error) != "Event loop is closed" or tb is None:
    return False
  return os.path.basename(tb.tb_frame.f_code.co_filename) == "base_events.py"


def install() -> None:
  """Filters orbax's tracebacks out of its loggers and hides the closed-loop callbacks (idempotent)."""
  for name in ("absl", ""):  # orbax logs through absl's logger (the root one without absl).
    if _QUIET not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(_QUIET)
  previous = sys.excepthook
  if getattr(previous, "_hetjax_quiet", False):
    return

  def hook(kind, error, tb):
    if _from_a_closed_loop(kind, error, tb):
      log.debug("dropped a callback on a closed event loop after a failed checkpoint read/write")
      return
    previous(kind, error, tb)

  hook._hetjax_quiet = True  # type: ignore[attr-defined]
  sys.excepthook = hook
