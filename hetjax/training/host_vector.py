"""The small per-host vector a reduction carries, read and written by column name.

Every host puts a few numbers into the reduction and gets every host's back as
rows `[hosts, k]` (invariant 3); writer and readers go by column name, so no
reader counts positions.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class HostVector:
  """The named columns of one kind of host vector, then an optional group of one value per host.

  Example:
    >>> vector = HostVector("compute_s", "stop", per_host="shares")
    >>> mine = vector.pack(compute_s=0.5, stop=0, shares=(16, 48))
    >>> rows = np.stack([mine, vector.pack(compute_s=0.25, stop=1, shares=(16, 48))])
    >>> vector.column(rows, "stop").tolist(), vector.per_host(rows).tolist()
    ([0.0, 1.0], [[16.0, 48.0], [16.0, 48.0]])
  """

  def __init__(self, *names: str, per_host: str | None = None):
    """`names`: the single-value columns, in order; `per_host`: a trailing group of one value
    per host (None: none)."""
    self.names, self.group = tuple(names), per_host
    self._index = {name: i for i, name in enumerate(self.names)}

  def pack(self, **values: float | Sequence[float]) -> np.ndarray:
    """This host's vector (float32, as the reduction carries it) from every column by name
    (a ValueError names a column missing or unknown)."""
    try:  # Once per step: no sets built.
      row = [float(values[name]) for name in self.names]
      row += list(values[self.group]) if self.group else []
    except KeyError:
      row = None
    if row is None or len(values) != len(self.names) + bool(self.group):
      wanted = list(self.names) + ([self.group] if self.group else [])
      raise ValueError(f"a host vector needs exactly {wanted}; got {sorted(values)}.")
    return np.array(row, np.float32)

  def column(self, rows: np.ndarray, name: str) -> np.ndarray:
    """Every host's value of column `name`, from the rows `[hosts, k]`."""
    return np.asarray(rows)[:, self._index[name]]

  def per_host(self, rows: np.ndarray) -> np.ndarray:
    """Every host's per-host group `[hosts, hosts]` (e.g. the shares each host used)."""
    rows = np.asarray(rows)
    start = len(self.names)
    return rows[:, start:start + rows.shape[0]]
