"""hetjax: synchronous data parallelism across hosts whose accelerators differ.

Public names load lazily, so the launcher and other stdlib-only tools can
import `hetjax.*` modules without paying for JAX.
"""

import importlib as _importlib

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
    "RoundsTrainer": "hetjax.modes.trainer",
    "RoundsConfig": "hetjax.modes.options",
    "Preempted": "hetjax.signals",
    "Interrupted": "hetjax.signals",
    "Stopped": "hetjax.signals",
    "HostsDisagree": "hetjax.agreement",
    "CheckpointConfig": "hetjax.checkpoint",
    "ArraySource": "hetjax.data",
    "DatasetInfo": "hetjax.data",
}

# Submodules the README uses as `hetjax.NAME.thing` after a plain `import hetjax`.
_SUBMODULES = ("testing", "metrics", "report", "progress", "checkpoint", "data", "optimizers",
               "signals")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_importlib.import_module(_EXPORTS[name]), name)
  if name in _SUBMODULES:
    return _importlib.import_module(f"hetjax.{name}")
  raise AttributeError(f"module 'hetjax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
