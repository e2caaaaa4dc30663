"""hetjax: synchronous data parallelism across hosts whose accelerators differ.

`Trainer` runs a job in any mode (`Sync`, the default; `Hybrid`; `Elastic`)
from a `Task`, an optax optimizer, an `ArraySource` and a `TrainConfig`.
Public names load lazily, so the launcher and other stdlib-only tools can
import `hetjax.*` modules without paying for JAX.
"""

import importlib as _importlib

__version__ = "0.1.0"

_EXPORTS = {
    "initialize": "hetjax.cluster.runtime",
    "topology": "hetjax.cluster.runtime",
    "Task": "hetjax.task",
    "from_functions": "hetjax.task",
    "from_linen": "hetjax.task",
    "from_nnx": "hetjax.task",
    "Weighted": "hetjax.task",
    "MASK": "hetjax.task",
    "Trainer": "hetjax.trainer",
    "TrainConfig": "hetjax.config",
    "train": "hetjax.trainer",
    "params_digest": "hetjax.trainer",
    "Sync": "hetjax.modes",
    "Hybrid": "hetjax.modes",
    "Elastic": "hetjax.modes",
    "Preempted": "hetjax.cluster.signals",
    "Interrupted": "hetjax.cluster.signals",
    "Stopped": "hetjax.cluster.signals",
    "HostsDisagree": "hetjax.training.agreement",
    "CheckpointConfig": "hetjax.config",
    "ArraySource": "hetjax.input.data",
    "DatasetInfo": "hetjax.input.data",
}

# Submodules the README uses as `hetjax.NAME.thing` after a plain `import hetjax`,
# by the family folder each lives in.
_SUBMODULES = {
    "testing": "hetjax.testing",
    "metrics": "hetjax.observe.metrics",
    "report": "hetjax.observe.report",
    "progress": "hetjax.observe.progress",
    "checkpoint": "hetjax.checkpoint",
    "data": "hetjax.input.data",
    "optimizers": "hetjax.optimizers",
    "signals": "hetjax.cluster.signals",
    "models": "hetjax.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(_importlib.import_module(_EXPORTS[name]), name)
  if name in _SUBMODULES:
    return _importlib.import_module(_SUBMODULES[name])
  raise AttributeError(f"module 'hetjax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
