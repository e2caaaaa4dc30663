"""Models hetjax can train, by name.

`build(name, kind=..., ...)` turns a model name and the dataset's kind into a
`hetjax.task.Task`, so the trainer never handles Flax modules or losses.
The names and their options (`catalog`) load without JAX; the Flax modules
(`registry`) load on first use.

Example:
  >>> task = build("cnn", kind="image", num_classes=10)
  >>> task = build("resnet18", kind="image", num_classes=10, width=8)
  >>> task = build("transformer", kind="tokens", vocab_size=256, max_len=128)
"""

import importlib as _importlib

from hetjax.models.catalog import KINDS, MODEL_NAMES, OPTIONS  # noqa: F401

_FROM_REGISTRY = ("CNN", "MLP", "MaskedBatchNorm", "ResNet", "ResNet50", "TransformerLM",
                  "build", "default_config", "losses", "preprocess")

__all__ = sorted(("KINDS", "MODEL_NAMES", "OPTIONS") + _FROM_REGISTRY)


def __getattr__(name: str):
  if name in _FROM_REGISTRY:
    return getattr(_importlib.import_module("hetjax.models.registry"), name)
  raise AttributeError(f"module 'hetjax.models' has no attribute {name!r}")
