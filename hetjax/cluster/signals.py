"""Stop signals: SIGTERM (a preemption notice, exit 75) and SIGINT (a user's Ctrl-C, 130).

The handler only raises a flag; it travels to every host in the next step's
reduction (DESIGN invariant 3), and every host stops, saving first, at the
boundary after the step that follows it (an overlapping loop dispatched that
step already). A second Ctrl-C is not caught: it interrupts at once. Outside
the step loop no boundary is coming, so a signal stops the host at once
(`installed(defer=False)`, the command line's).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

from hetjax.cluster import watchdog
from hetjax.exits import INTERRUPTED_EXIT, PREEMPTED_EXIT, JobExit

# The codes travel as float32 in the timing rows; the largest over the hosts
# wins, so a user's stop is not mistaken for a preemption.
NONE, TERM, INT = 0, 1, 2
_CODES = {signal.SIGTERM: TERM, signal.SIGINT: INT}


class Stopped(JobExit):
  """Every host stopped at the same step boundary because a host got a stop signal.

  Raised by `Trainer.fit`; the command line leaves with `exit_code`.

  Args:
    step: the steps done when the hosts stopped (None: outside the steps).
    directory: the checkpoint folder the state was saved in, or None.
    during: the step this host was in when the signal came, if it got it.

  Example (`except hetjax.Stopped as stop:` around `fit` catches every stop):
    >>> stop = hetjax.Interrupted(40, None)
    >>> isinstance(stop, hetjax.Stopped), stop.step
    (True, 40)
  """

  exit_code = 1
  signal_name = "a stop signal"

  def __init__(self, step: int | None, directory: str | None, during: int | None = None):
    self.step, self.directory, self.during = step, directory, during
    if step is None:
      text = (f"stopped by {self.signal_name} outside the training steps; nothing was saved; "
              f"exiting with code {self.exit_code}.")
    else:
      text = self._message() + ("" if during is None else
                                f" (The signal reached this host during step {during}.)")
    super().__init__(text)

  def _message(self) -> str:
    return f"stopped by {self.signal_name} after step {self.step}."


class Preempted(Stopped):
  """SIGTERM reached a host: every host saved (when it can) and exits `exit_code`, which the
  launchers read as "restart me" (it resumes from the checkpoint). Args as for `Stopped`.

  Example:
    >>> stop = hetjax.Preempted(120, "/ckpt")
    >>> stop.exit_code, str(stop).split(";")[0]
    (75, 'preempted: checkpoint of step 120 saved in /ckpt')
  """

  exit_code = PREEMPTED_EXIT
  signal_name = "SIGTERM"

  def _message(self) -> str:
    if self.directory is None:
      return (f"preempted (SIGTERM) after step {self.step}; nothing was saved (no --ckpt-dir), "
              f"exiting with code {self.exit_code}.")
    return (f"preempted: checkpoint of step {self.step} saved in {self.directory}; exiting "
            f"with code {self.exit_code} so the job is restarted and resumes there.")


class Interrupted(Stopped):
  """Ctrl-C (SIGINT) reached a host: a user's stop, not a preemption (never restarted). Args
  as for `Stopped`.

  Example:
    >>> hetjax.Interrupted(7, None).exit_code
    130
  """

  exit_code = INTERRUPTED_EXIT
  signal_name = "Ctrl-C"

  def _message(self) -> str:
    if self.directory is None:
      return (f"stopped by Ctrl-C after step {self.step}; nothing was saved (no --ckpt-dir), "
              "so a new run starts from the beginning.")
    return (f"stopped after step {self.step}, checkpoint saved in {self.directory}; "
            "run the same command to resume.")


def stopped(code: float, step: int | None, directory: str | None) -> Stopped:
  """The exception for the largest stop code any host sent; on the host that got the signal,
  it also names the step it came in (the log shows the at most two steps run after it).
  """
  during, REQUESTS.last_during = REQUESTS.last_during, None
  return (Interrupted if code >= INT else Preempted)(step, directory, during)


class StopRequests:
  """Catches SIGTERM and SIGINT while installed; `code` is what this host sends. The command
  line installs `REQUESTS` before joining, so JAX's own SIGTERM handler cannot take a signal.
  """

  def __init__(self):
    self.code = NONE
    self.during: int | None = None  # The step this host was in when the first signal came.
    self.last_during: int | None = None  # `during` of the request just handled.
    self._depth = 0
    self._deferring = 0  # Installs inside a step loop: the flag waits for the boundary.
    self._leaving = False  # Stopped at a boundary, saved: later signals change nothing.
    self._previous: dict[int, object] = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    if watchdog.WATCHDOG.ending.is_set() or watchdog.WATCHDOG.failing.is_set():
      return  # This host leaves with the job's verdict, or its failure: not a preemption.
    if self._leaving:
      return  # Its stop is on the way out, with what it saved (the launcher's own SIGTERM).
    if self.code == NONE:
      self.during = watchdog.WATCHDOG.position.step if watchdog.WATCHDOG.position else None
    self.code = max(self.code, _CODES[signum])
    if not self._deferring:
      code, self.code = self.code, NONE
      raise stopped(code, None, None)
    if signum == signal.SIGINT:
      # A second Ctrl-C interrupts at once.
      signal.signal(signal.SIGINT, signal.default_int_handler)
      print("hetjax: Ctrl-C: every host stops within two steps (Ctrl-C again to "
            "abort at once)", file=sys.stderr, flush=True)

  @contextlib.contextmanager
  def installed(self, defer: bool = True) -> Iterator["StopRequests"]:
    """Catches the stop signals inside the block (main thread only). `defer`: flag for the
    next step boundary; False raises at once unless a deferring install is active inside.
    """
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    if self._depth == 0:
      self._leaving = False
      for signum in _CODES:
        previous = signal.signal(signum, self._handle)
        # A handler installed outside Python reads as None and cannot be put back.
        self._previous[signum] = signal.SIG_DFL if previous is None else previous
    self._depth += 1
    self._deferring += defer
    try:
      yield self
    finally:
      self._deferring -= defer
      self._depth -= 1
      if self._depth == 0:
        for signum, previous in self._previous.items():
          signal.signal(signum, previous)
        self._previous.clear()

  def clear(self) -> None:
    """Forgets a handled request (after the hosts stopped for it)."""
    self.code = NONE
    self.last_during, self.during = self.during, None

  def leave(self) -> None:
    """Stopped and saved: until the outermost install ends, the launcher's SIGTERM to the
    group must not replace "checkpoint of step N saved" with "nothing was saved"."""
    self._leaving = True


REQUESTS = StopRequests()
