"""One progress line for the whole job, printed by process 0 only.

On a terminal the line is rewritten in place (`\\r`); in a log, a plain line
every `every` steps. Every host sees the same records, so one speaks for all.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Callable, TextIO

_RECENT = 20  # Steps whose mean duration predicts the rest.
_WARMUP = 2   # First steps (compilation) that would spoil the ETA.


def format_eta(seconds: float) -> str:
  """`1:02:03` / `2:03` style; `?` while unknown."""
  if not seconds >= 0 or seconds == float("inf"):
    return "?"
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_line(record: dict[str, Any], total_steps: int, eta_s: float) -> str:
  """The progress text for one metrics record (no line ending)."""
  step = record["step"]  # Steps done, counting this one (the records' numbering).
  width = len(str(total_steps))
  shares = "/".join(str(s) for s in record["shares"])
  evaluated = record.get("eval") or {}
  shown = "accuracy" if "accuracy" in evaluated else "loss"
  metrics, hosts = record.get("metrics", {}), range(len(record["shares"]))
  rounds = "tau/0" in metrics  # A hybrid or elastic run: one record per round.
  work = (f"shares {shares}" if not rounds else
          "taus " + "/".join(f"{metrics[f'tau/{i}']:.0f}" for i in hosts) + f"  samples {shares}  "
          f"spread max {max(metrics[f'spread/{i}'] for i in hosts):.3g}  "
          f"reduction {metrics['reduction_s'] * 1e3:.0f} ms")
  return (f"{'round' if rounds else 'step'} {step:{width}d}/{total_steps}  loss {record['loss']:.4f}  "
          + (f"eval {shown} {evaluated[shown]:.4f}  " if evaluated else "")
          + (f"lr {record['lr']:.3g}  " if "lr" in record else "")
          + f"{record['samples_per_sec']:,.0f} samples/s  {work}  ETA {format_eta(eta_s)}"
          + ("  (emulated speeds)" if record["emulated"] else ""))


class Progress:
  """Shows step/total, loss, samples/s, every host's share and the ETA."""

  def __init__(self, total_steps: int, *, host_id: int, stream: TextIO | None = None,
               every: int = 10, tty: bool | None = None,
               clock: Callable[[], float] = time.monotonic, min_interval_s: float = 0.1):
    """Only host 0 prints, to `stream` (default stderr): on a terminal (`tty`: detected, or
    forced) one line redrawn at most every `min_interval_s` of `clock`; else a line every
    `every` steps. `total_steps`: the step count at the end of the run."""
    if total_steps < 0:
      raise ValueError(f"total_steps must be >= 0, got {total_steps}.")
    if every < 1:
      raise ValueError(f"every must be >= 1 step, got {every}.")
    self.total_steps, self.every = total_steps, every
    self.enabled = host_id == 0
    self._stream = stream if stream is not None else sys.stderr
    isatty = getattr(self._stream, "isatty", lambda: False)
    self._tty = bool(isatty()) if tty is None else tty
    self._clock, self._min_interval_s = clock, min_interval_s
    self._recent: list[float] = []
    self._seen = 0
    self._last_draw = -float("inf")
    self._pending: str | None = None  # A terminal line not yet drawn.
    self._width = 0

  def eta_s(self, record: dict[str, Any]) -> float:
    """Seconds left: steps left times the mean of recent steps (the compiling first
    steps count only until later ones are known)."""
    left = max(0, self.total_steps - record["step"])
    return left * sum(self._recent) / len(self._recent) if self._recent else float("inf")

  def update(self, record: dict[str, Any]) -> None:
    """Takes one step's metrics record; prints when it is time to."""
    if not self.enabled:
      return
    self._seen += 1
    if self._seen == _WARMUP + 1:
      self._recent = []
    self._recent = (self._recent + [record["step_s"]])[-_RECENT:]
    line = format_line(record, self.total_steps, self.eta_s(record))
    if not self._tty:
      if (record["step"] % self.every == 0 or record["step"] == self.total_steps
          or record.get("eval")):  # An evaluation is always shown.
        self._stream.write(line + "\n")
        self._stream.flush()
      return
    self._pending = line
    if self._clock() - self._last_draw >= self._min_interval_s:
      self._draw()

  def _draw(self) -> None:
    columns = shutil.get_terminal_size((120, 24)).columns - 1
    line = self._pending[:columns]
    # Pad over the previous, possibly longer, line.
    self._stream.write("\r" + line + " " * max(0, self._width - len(line)))
    self._stream.flush()
    self._width, self._pending, self._last_draw = len(line), None, self._clock()

  def close(self) -> None:
    """Draws the last line and ends it, so later output starts on a new line."""
    if self.enabled and self._tty and (self._pending or self._width):
      if self._pending:
        self._draw()
      self._stream.write("\n")
      self._stream.flush()
      self._width = 0

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


class _Lines:
  """A stream that hands each written line to `log` (the API's `fit(log=...)`)."""

  def __init__(self, log: Callable[[str], Any]):
    self._log = log

  def write(self, text: str) -> None:
    for line in text.splitlines():
      self._log(line)

  def flush(self) -> None:
    pass


def log_sink(total_steps: int, *, host_id: int, every: int,
             log: Callable[[str], Any] = print) -> Callable[[dict[str, Any]], None]:
  """`Trainer.fit(log_every=N)`'s sink: `hetjax train`'s progress line every `every` steps,
  through `log`, so the API and the CLI show the same line."""
  return Progress(total_steps, host_id=host_id, stream=_Lines(log), every=every, tty=False).update
