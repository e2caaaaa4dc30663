"""The `Balancer` protocol, the fixed policies, and the factory the trainer calls. Pure numpy."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from hetjax.balancer.profiling import ProfilingBalancer
from hetjax.balancer.split import check_state, equal_split, parse_assignment, validate_shares

MODES = ("fixed", "equal", "static", "dynamic")


class Balancer(Protocol):
  """Decides each host's share of the global batch, step by step."""

  name: str

  def shares(self, step: int) -> tuple[int, ...]:
    """The per-host batch sizes for `step`; they sum to the global batch."""
    ...

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    """Feeds back every host's measured local compute seconds for `step`."""
    ...

  def state_dict(self) -> dict[str, Any]:
    """What a checkpoint must hold to continue with the same split (JSON-able)."""
    ...

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores `state_dict()`; raises `ValueError` if it belongs to another job."""
    ...


class FixedBalancer:
  """The same split at every step (`equal`, or one given by hand)."""

  def __init__(self, shares: Sequence[int], name: str = "fixed"):
    self._shares = tuple(int(s) for s in shares)
    self.name = name

  def shares(self, step: int) -> tuple[int, ...]:
    return self._shares

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    del step, shares, compute_s  # A fixed split learns nothing.

  def state_dict(self) -> dict[str, Any]:
    return {"kind": self.name, "shares": list(self._shares)}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    check_state(state, kind=self.name, shares=list(self._shares))


def make_balancer(assignment: str | Sequence[int], global_batch: int, num_hosts: int, *,
                  mode: str | None = None, granularity: Sequence[int] | None = None,
                  **options: Any) -> Balancer:
  """Builds the balancer for `assignment` ('equal' or explicit shares) or `mode` (default
  from `assignment`); 'static' / 'dynamic' take `granularity` and `options` (warmup_steps, ...)."""
  if global_batch < 1:
    raise ValueError(f"global batch must be >= 1, got {global_batch}.")
  if isinstance(assignment, str):
    assignment = parse_assignment(assignment)
  if mode is None:
    mode = "equal" if assignment == "equal" else "fixed"
  if mode not in MODES:
    raise ValueError(f"unknown balancer mode {mode!r}; choose one of {', '.join(MODES)}.")
  if mode in ("static", "dynamic"):
    if assignment != "equal":
      raise ValueError(f"mode {mode!r} starts from the equal split and sizes shares itself; "
                       "pass assignment 'equal' instead of explicit shares.")
    return ProfilingBalancer(global_batch, num_hosts, granularity, mode, **options)
  if options:
    raise ValueError(f"options {sorted(options)} apply to 'static'/'dynamic' only, not {mode!r}.")
  if mode == "equal" or assignment == "equal":
    return FixedBalancer(equal_split(global_batch, num_hosts), name="equal")
  return FixedBalancer(validate_shares(np.asarray(assignment).tolist(), global_batch, num_hosts))


def taus_from_speeds(round_steps: int, step_s: Sequence[float]) -> tuple[int, ...]:
  """Local steps per round: `tau_i = max(1, round(H * v_i / v_max))`, `v_i = 1 / step_s[i]`
  (the fastest host runs `round_steps` = H). Shared by the trainer and the simulator."""
  step_s = np.asarray(step_s, np.float64)
  if not np.all(step_s > 0):
    raise ValueError(f"local step seconds must be > 0, got {step_s.tolist()}.")
  v = 1.0 / step_s
  return tuple(int(max(1, np.floor(round_steps * x / v.max() + 0.5))) for x in v)
