"""The trainer's per-step records, bounded: a window of recent steps plus running totals.

A million-step run must not keep a million per-host rows: complete records go
to metrics.jsonl (`metrics.RecordStream`); here only the last steps stay, and
what the summary needs of older ones is folded into totals (`Folded`). The
rounds modes record a round as a step, with their own per-host `series`.

Entry `k` of the lists is history index `dropped + k` (0: this trainer's first
step). Write with `record` and `arrived`; the lists are for reading.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

WINDOW = 1000  # Steps kept; the lists are trimmed back to this when they reach twice it.


def _plain(values: Sequence[Any]) -> list[Any]:
  """Python numbers (JSON's), however given: numpy scalars of a gathered row, or ints (taus)."""
  return [v.item() if hasattr(v, "item") else v for v in values]


@dataclasses.dataclass
class Folded:
  """Totals of the steps dropped from the window (after warm-up where it says so)."""

  steps: int = 0
  time_s: float = 0.0            # all step seconds (the records' clock)
  steady_steps: int = 0
  steady_step_s: float = 0.0
  steady_samples: int = 0
  steady_compute_s: list[float] = dataclasses.field(default_factory=list)  # per host
  steady_wait_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class History:
  """Per-step records of the recent steps; `compute_s` and `wait_s` are `[steps][hosts]`.

  `wait_s` (and maybe `compute_s` and a series) lags: a sync step's travels in
  the collective two steps later, a round's one round later (the last in
  `summary`'s). It arrives through `arrived`, in step order.

  Example:
    >>> h = History(series={"tau": []})
    >>> h.record((16, 48), step_s=0.1, loss=2.3, metrics={"loss": 2.3}, compute_s=[0.08, 0.09],
    ...          tau=[1, 3])
    >>> list(h.awaiting)                       # step 0's wait is not known yet
    [0]
    >>> h.arrived(0, wait_s=[0.02, 0.01])
    >>> h.steps, h.per_host(2)[1]["tau"], list(h.awaiting)
    (1, [3], [])
  """

  shares: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
  compute_s: list[list[float]] = dataclasses.field(default_factory=list)
  wait_s: list[list[float]] = dataclasses.field(default_factory=list)
  step_s: list[float] = dataclasses.field(default_factory=list)
  loss: list[float] = dataclasses.field(default_factory=list)
  metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
  # By history index: the learning rate (while records are built) and evaluations.
  lr: dict[int, float] = dataclasses.field(default_factory=dict)
  evals: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
  # A mode's own per-host figures, `[steps][hosts]` each (the rounds modes: "tau", "spread").
  series: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
  dropped: int = 0               # history indices before the window
  folded: Folded = dataclasses.field(default_factory=Folded)
  warmup: int = 2                # leading steps kept out of the steady totals
  window: int | None = None      # steps kept, trimmed back to at twice it (None: WINDOW)

  def record(self, shares: Sequence[int], step_s: float, loss: float,
             metrics: dict[str, float], **per_host: Sequence[float]) -> None:
    """Appends one step; `per_host`: the `[hosts]` columns known now (`compute_s`, a series)."""
    self.shares.append(tuple(shares))
    self.step_s.append(float(step_s))
    self.loss.append(float(loss))
    self.metrics.append(metrics)
    for name, values in per_host.items():
      self._column(name).append(_plain(values))
    self.trim()

  def arrived(self, index: int, **per_host: Sequence[float]) -> None:
    """The lagging `[hosts]` figures (`wait_s`, ...) of history index `index`, in step order;
    ignored for a step that has them or is not recorded, so a caller need not count."""
    if index != self.dropped + len(self.wait_s) or index >= self.steps:
      return
    for name, values in per_host.items():
      self._column(name).append(_plain(values))

  @property
  def awaiting(self) -> range:
    """History indices whose lagging figures have not arrived (at most the last few)."""
    return range(self.dropped + len(self.wait_s), self.steps)

  def _column(self, name: str) -> list[list[float]]:
    """A per-host column by name: `compute_s`, `wait_s`, or one of the mode's series."""
    return getattr(self, name) if name in ("compute_s", "wait_s") else self.series[name]

  @property
  def steps(self) -> int:
    """Steps recorded in the whole run (dropped ones included)."""
    return self.dropped + len(self.shares)

  def trim(self, warmup: int | None = None, window: int | None = None) -> None:
    """Folds all but the last `window` steps into the totals, once the lists reach 2x; only
    steps whose wait is known (their records made) are dropped."""
    warmup = self.warmup if warmup is None else warmup
    window = window or self.window or WINDOW
    cut = min(len(self.shares) - window, len(self.wait_s))
    if len(self.shares) < 2 * window or cut <= 0:
      return
    f = self.folded
    hosts = len(self.shares[0])
    if not f.steady_compute_s:
      f.steady_compute_s, f.steady_wait_s = [0.0] * hosts, [0.0] * hosts
    for k in range(cut):
      f.time_s += self.step_s[k]
      if self.dropped + k >= warmup:
        f.steady_steps += 1
        f.steady_step_s += self.step_s[k]
        f.steady_samples += sum(self.shares[k])
        for h in range(hosts):
          f.steady_compute_s[h] += self.compute_s[k][h]
          f.steady_wait_s[h] += self.wait_s[k][h]
    f.steps += cut
    for name in ("shares", "compute_s", "wait_s", "step_s", "loss", "metrics"):
      del getattr(self, name)[:cut]
    for values in self.series.values():
      del values[:cut]
    self.dropped += cut
    self.lr = {i: v for i, v in self.lr.items() if i >= self.dropped}
    latest = max(self.evals, default=None)  # The summary reports it, however old.
    self.evals = {i: e for i, e in self.evals.items() if i >= self.dropped or i == latest}

  def _steady_from(self, warmup: int) -> int:
    """The first window entry after warm-up; a run shorter than it counts all but its first
    step, or all."""
    if self.dropped == 0 and len(self.step_s) <= warmup:
      return 1 if len(self.step_s) > 1 else 0
    return max(0, warmup - self.dropped)

  def samples_per_sec(self, warmup: int) -> float:
    """Samples over step seconds after warm-up, whole run (0.0 before any timed step)."""
    skip, f = self._steady_from(warmup), self.folded
    seconds = f.steady_step_s + sum(self.step_s[skip:])
    samples = f.steady_samples + sum(sum(s) for s in self.shares[skip:])
    return samples / seconds if seconds > 0 else 0.0

  def per_host(self, hosts: int, warmup: int | None = None) -> list[dict[str, Any]]:
    """Each host's window lists (`batch`: its shares, `compute_s`, `wait_s`, each series) and,
    with `warmup`, the part of its busy seconds after warm-up it waited (`idle_fraction`)."""
    out = [{"batch": [s[i] for s in self.shares], "compute_s": [c[i] for c in self.compute_s],
            "wait_s": [w[i] for w in self.wait_s],
            **{name: [v[i] for v in values] for name, values in self.series.items()}}
           for i in range(hosts)]
    if warmup is not None:
      _, _, compute, wait = self.steady_totals(warmup, hosts)
      for i, row in enumerate(out):
        busy = compute[i] + wait[i]
        row["idle_fraction"] = wait[i] / busy if busy else 0.0
    return out

  def steady_totals(self, warmup: int, hosts: int) -> tuple[int, float, list[float], list[float]]:
    """(steps, step seconds, compute per host, wait per host) after warm-up, whole run."""
    skip, f = self._steady_from(warmup), self.folded
    step_s = self.step_s[skip:]
    compute = [sum(c[h] for c in self.compute_s[skip:]) for h in range(hosts)]
    wait = [sum(w[h] for w in self.wait_s[skip:]) for h in range(hosts)]
    if f.steady_compute_s:
      compute = [a + b for a, b in zip(compute, f.steady_compute_s)]
      wait = [a + b for a, b in zip(wait, f.steady_wait_s)]
    return f.steady_steps + len(step_s), f.steady_step_s + sum(step_s), compute, wait
