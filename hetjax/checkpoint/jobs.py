"""Which job a checkpoint belongs to: a run continues only a checkpoint of its own job.

The arrays alone do not say it (another optimizer can have the same
shapes), so each checkpoint's metadata holds this description, and a
mismatch is refused naming what differs instead of loading wrong state.
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any


def describe_job(state: Any, job: dict[str, Any]) -> dict[str, Any]:
  """What a checkpoint must match to be continued: shapes, optimizer, settings."""
  def shapes(tree: PyTree) -> dict[str, str]:
    return {jax.tree_util.keystr(path): f"{tuple(x.shape)} {x.dtype}"
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}

  return {"params": shapes(state.params), "model_state": shapes(state.model_state),
          "optimizer": str(jax.tree.structure(state.opt_state)), **job}


def job_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """Human lines naming what differs between two `describe_job` results."""
  out = []
  for key in sorted(set(saved) | set(current)):
    a, b = saved.get(key), current.get(key)
    if a == b:
      continue
    if isinstance(a, dict) and isinstance(b, dict):
      names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
      shown = ", ".join(f"{n}: saved {a.get(n, 'absent')}, now {b.get(n, 'absent')}"
                        for n in names[:3])
      more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
      out.append(f"{key} differ ({len(names)} entries): {shown}{more}")
    elif key == "optimizer":
      out.append("optimizer state has another structure (another optimizer or schedule)")
    else:
      out.append(f"{key}: saved {a!r}, now {b!r}")
  return out
