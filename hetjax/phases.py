"""The lifecycle's phases: one name for each part of a run, announced to whoever listens.

The watchdog (a deadline on every wait, evaluation too) and the goodput record
(where the wall time went) both need them, so they are named once here: the
trainer announces them (`within`), listeners subscribe (`PHASES.subscribe`).
Phases nest; `PHASES.current` is the innermost. Stdlib only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Protocol

JOINING = "joining"          # jax.distributed.initialize: waiting for every host to join.
BUILDING = "building"        # Validation, agreement on the configuration, the mode's programs.
RESTORING = "restoring"      # Reading the newest checkpoint.
TRAINING = "training"        # The step (round) loop; compiling happens in its first steps.
EVALUATION = "evaluation"    # Evaluating on a held-out split.
CHECKPOINT = "checkpoint"    # Saving, or waiting for a background save to finish.
AGREEMENT = "agreement"      # Comparing the hosts' replicas.
SUMMARY = "summary"          # Gathering the run's figures at its end.
NAMES = (JOINING, BUILDING, RESTORING, TRAINING, EVALUATION, CHECKPOINT, AGREEMENT, SUMMARY)


class Listener(Protocol):
  """Told of every phase this process enters and leaves (from the announcing thread)."""

  def phase_started(self, name: str, step: int | None, at: float) -> None: ...

  def phase_ended(self, name: str, step: int | None, at: float, failed: bool) -> None: ...


class Phases:
  """The process's phase stack and its listeners (one per process: `PHASES`)."""

  def __init__(self, clock: Callable[[], float] = time.time):
    self._clock = clock
    self._lock = threading.Lock()
    self._stack: list[str] = []
    self._listeners: list[Listener] = []

  @property
  def current(self) -> str | None:
    """The innermost phase this process is in (None outside every phase)."""
    with self._lock:
      return self._stack[-1] if self._stack else None

  @contextlib.contextmanager
  def subscribe(self, listener: Listener) -> Iterator[Listener]:
    """Tells `listener` of every phase entered or left inside the block."""
    with self._lock:
      self._listeners.append(listener)
    try:
      yield listener
    finally:
      with self._lock:
        self._listeners.remove(listener)

  @contextlib.contextmanager
  def within(self, name: str, step: int | None = None) -> Iterator[None]:
    """Announces the block as phase `name` (one of `NAMES`), at `step` when it has one."""
    if name not in NAMES:
      raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(NAMES)}")
    with self._lock:
      self._stack.append(name)
      listeners = list(self._listeners)
    at = self._clock()
    for listener in listeners:
      listener.phase_started(name, step, at)
    failed = True
    try:
      yield
      failed = False
    finally:
      at = self._clock()
      with self._lock:
        self._stack.pop()
        listeners = list(self._listeners)
      for listener in listeners:
        listener.phase_ended(name, step, at, failed)


PHASES = Phases()
within = PHASES.within  # What the trainer wraps each part of a run in.
