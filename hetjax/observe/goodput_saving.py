"""What balancing saved: the step an equal split would have taken, from the same timings.

Each host's measured seconds per sample (after warm-up) priced at an equal
share: the slowest sets the equal step, plus the reduction (the fastest host's
wait). The balanced step is priced the same way from what ran, so an equal-split
run saves exactly nothing and dispatch stays out of both. A model: compute is
taken as linear in the samples, which small shares on a GPU beat.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class Saving:
  """The equal split against the balanced one, per step and over the job's steps."""

  equal_step_s: float       # modelled step of an equal split
  balanced_step_s: float    # modelled step of the split that ran
  measured_step_s: float    # the mean measured step, for comparison
  steps: int                # the steps the job ran (every attempt's)
  saved_s: float            # (equal - balanced) x steps
  emulated: bool

  @property
  def fraction(self) -> float:
    """The part of the equal split's time the balanced split saved."""
    return 1.0 - self.balanced_step_s / self.equal_step_s if self.equal_step_s > 0 else 0.0


def equal_split(shares: Sequence[Sequence[int]], compute_s: Sequence[Sequence[float]],
                wait_s: Sequence[Sequence[float]], step_s: Sequence[float], global_batch: int,
                *, steps: int | None = None, emulated: bool = False) -> Saving | None:
  """The saving from per-step `[steps][hosts]` shares, compute and wait seconds (after warm-up).

  `steps`: how many steps the job ran (default: those given). None where a
  host never had samples (its speed is unknown) or no step is given.
  """
  if not shares:
    return None
  hosts = len(shares[0])
  per_sample = []
  for h in range(hosts):
    samples = sum(s[h] for s in shares)
    if samples <= 0:
      return None
    per_sample.append(sum(c[h] for c in compute_s) / samples)
  reduction = sum(min(w) for w in wait_s) / len(wait_s)
  equal = max(p * global_batch / hosts for p in per_sample) + reduction
  balanced = sum(max(c) for c in compute_s) / len(compute_s) + reduction
  steps = len(shares) if steps is None else steps
  return Saving(equal, balanced, sum(step_s) / len(step_s), steps, (equal - balanced) * steps,
                emulated)


def from_records(records: Sequence[dict], warmup: int, steps: int | None = None) -> Saving | None:
  """`equal_split` of metrics records (`hetjax.observe.metrics` schema), after warm-up."""
  run = list(records[warmup:]) or list(records[1:]) or list(records)
  if not run:
    return None
  return equal_split([r["shares"] for r in run], [r["compute_s"] for r in run],
                     [r["wait_s"] for r in run], [r["step_s"] for r in run],
                     run[-1]["global_batch"], steps=len(records) if steps is None else steps,
                     emulated=any(r["emulated"] for r in records))
