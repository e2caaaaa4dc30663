"""How the global batch is split between hosts. Pure numpy, no JAX.

Every host computes the assignment itself from values every host holds
(DESIGN.md invariant 3), so an assignment policy must be deterministic. This
module holds the policies that need no profiling (`equal`, a fixed explicit
split); the profiling balancer plugs in behind the same `Balancer` protocol:
`shares(step)` before a step, `observe(...)` with the timing vector after it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Balancer(Protocol):
  """Decides each host's share of the global batch, step by step."""

  name: str

  def shares(self, step: int) -> tuple[int, ...]:
    """The per-host batch sizes for `step`; they sum to the global batch."""
    ...

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    """Feeds back every host's measured local compute seconds for `step`."""
    ...


def equal_split(global_batch: int, num_hosts: int) -> tuple[int, ...]:
  """The plain DDP split: `B // N` each, the remainder to the first hosts."""
  base, rest = divmod(global_batch, num_hosts)
  return tuple(base + (1 if i < rest else 0) for i in range(num_hosts))


def validate_shares(shares: Sequence[int], global_batch: int, num_hosts: int) -> tuple[int, ...]:
  """Checks an explicit split; raises `ValueError` naming what is wrong."""
  shares = tuple(int(s) for s in shares)
  if len(shares) != num_hosts:
    raise ValueError(f"assignment {','.join(map(str, shares))} has {len(shares)} entries "
                     f"but the job has {num_hosts} hosts; give one share per host.")
  if any(s < 0 for s in shares):
    raise ValueError(f"assignment {','.join(map(str, shares))} has a negative share; "
                     "every share must be >= 0.")
  if sum(shares) != global_batch:
    raise ValueError(f"assignment {','.join(map(str, shares))} sums to {sum(shares)} "
                     f"but the global batch is {global_batch}; the shares must add up to it.")
  return shares


def parse_assignment(text: str) -> str | tuple[int, ...]:
  """Parses `--assignment`: the word `equal` or comma-separated integers."""
  text = text.strip()
  if text == "equal":
    return "equal"
  try:
    return tuple(int(p) for p in text.split(","))
  except ValueError:
    raise ValueError(f"--assignment must be 'equal' or comma-separated integers such as "
                     f"5,23,36; got {text!r}.") from None


class FixedBalancer:
  """The same split at every step (`equal`, or one given by hand)."""

  def __init__(self, shares: Sequence[int], name: str = "fixed"):
    self._shares = tuple(int(s) for s in shares)
    self.name = name

  def shares(self, step: int) -> tuple[int, ...]:
    return self._shares

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    del step, shares, compute_s  # A fixed split learns nothing.


def make_balancer(assignment: str | Sequence[int], global_batch: int, num_hosts: int) -> Balancer:
  """Builds the balancer for `assignment` ('equal' or explicit shares)."""
  if global_batch < 1:
    raise ValueError(f"global batch must be >= 1, got {global_batch}.")
  if isinstance(assignment, str):
    assignment = parse_assignment(assignment)
  if assignment == "equal":
    return FixedBalancer(equal_split(global_batch, num_hosts), name="equal")
  return FixedBalancer(validate_shares(np.asarray(assignment).tolist(), global_batch, num_hosts))
