"""Splits that need no profiling, and the checks every split passes. Pure numpy."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


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


def check_state(state: dict[str, Any], **expected: Any) -> None:
  """Refuses balancer state written for another mode, batch or host count."""
  differ = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
  if differ:
    what = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differ.items())
    raise ValueError(f"the saved balancer state belongs to another configuration ({what}); "
                     "start the balancer afresh instead of restoring it.")


def round_to_sum(values: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
  """Integers near `values` (each within `[0, cap]`) that sum to `total`."""
  values = np.maximum(np.asarray(values, dtype=np.float64), 0.0)
  if values.sum() > total:  # Scale down first: the loop below can only add.
    values = values * (total / values.sum())
  out = np.minimum(np.floor(np.maximum(values, 0.0)).astype(np.int64), caps)
  frac = np.maximum(values, 0.0) - out
  order = np.lexsort((np.arange(len(values)), -frac))  # Largest fraction, then index.
  rest = total - int(out.sum())
  for pass_limit in (1, None):  # One each by fraction first, then fill any room left.
    for i in order:
      if rest <= 0:
        break
      room = int(caps[i] - out[i])
      add = min(room, rest) if pass_limit is None else min(room, rest, 1)
      out[i] += add
      rest -= add
  return out
