"""hetjax: synchronous data parallelism across hosts whose accelerators differ.

Public names load lazily, so the launcher and other stdlib-only tools can
import `hetjax.*` modules without paying for JAX.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "hetjax.runtime",
    "topology": "hetjax.runtime",
    "Task": "hetjax.task",
    "from_functions": "hetjax.task",
    "from_linen": "hetjax.task",
    "from_nnx": "hetjax.task",
    "Weighted": "hetjax.task",
    "MASK": "hetjax.task",
    "Trainer": "hetjax.trainer",
    "TrainConfig": "hetjax.trainer",
    "train": "hetjax.trainer",
    "params_digest": "hetjax.trainer",
    "Preempted": "hetjax.trainer",
    "CheckpointConfig": "hetjax.checkpoint",
    "ArraySource": "hetjax.data",
    "DatasetInfo": "hetjax.data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'hetjax' has no attribute {name!r}")
