"""hetjax: synchronous data parallelism across hosts whose accelerators differ.

`Trainer` runs a job in any mode (`Sync`, the default; `Hybrid`; `Elastic`)
from a `Task`, an optax optimizer, an `ArraySource` and a `TrainConfig`.
Public names load lazily, so the launcher and other stdlib-only tools can
import `hetjax.*` modules without paying for JAX.
"""

import importlib as _importlib

__version__ = "0.1.0"

_MODULE_EXPORTS = {
    "hetjax.cluster.runtime": ("initialize", "topology"),
    "hetjax.task": ("Task", "from_functions", "from_linen", "from_nnx", "Weighted", "MASK"),
    "hetjax.trainer": ("Trainer", "train", "params_digest"),
    "hetjax.config": ("TrainConfig", "CheckpointConfig"),
    "hetjax.modes": ("Sync", "Hybrid", "Elastic"),
    "hetjax.cluster.signals": ("Preempted", "Interrupted", "Stopped"),
    "hetjax.training.agreement": ("HostsDisagree",),
    "hetjax.input.data": ("ArraySource", "DatasetInfo"),
}
_EXPORTS = {name: module for module, names in _MODULE_EXPORTS.items() for name in names}

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
