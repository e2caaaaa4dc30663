"""The built-in models as Flax modules, and `build`, which makes their `Task`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hetjax import task as task_lib
from hetjax.models import losses, preprocess
from hetjax.models.catalog import KINDS, MODEL_NAMES
from hetjax.models.cnn import CNN
from hetjax.models.mlp import MLP
from hetjax.models.resnet import MaskedBatchNorm, ResNet, ResNet50
from hetjax.models.transformer import TransformerLM

_NOUNS = {"image": "image", "tokens": "token"}  # For error messages.


@dataclasses.dataclass(frozen=True)
class _Spec:
  module: type
  kind: str  # The dataset kind the model consumes.
  size_arg: str  # The constructor argument the dataset determines.
  loss: Callable
  mask_arg: str | None = None  # The argument its BatchNorm takes the padding mask by.


_SPECS = {
    "mlp": _Spec(MLP, "image", "num_classes", losses.classification),
    "cnn": _Spec(CNN, "image", "num_classes", losses.classification),
    "resnet18": _Spec(ResNet, "image", "num_classes", losses.classification, "mask"),
    "transformer": _Spec(TransformerLM, "tokens", "vocab_size", losses.next_token),
    "resnet50": _Spec(ResNet50, "image", "num_classes", losses.classification, "mask"),
}
assert tuple(_SPECS) == MODEL_NAMES


def _spec(name: str) -> _Spec:
  if name not in _SPECS:
    raise ValueError(f"Unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}.")
  return _SPECS[name]


def default_config(name: str) -> dict[str, Any]:
  """The options `build(name, ...)` accepts as overrides, with their defaults (not the
  dataset's `num_classes` / `vocab_size`)."""
  spec = _spec(name)
  return {f.name: f.default for f in dataclasses.fields(spec.module)
          if f.init and f.name not in ("parent", "name", spec.size_arg)}


def build(name: str, *, kind: str, num_classes: int | None = None,
          vocab_size: int | None = None, **overrides: Any) -> task_lib.Task:
  """The `Task` hetjax trains for model `name` on data of `kind`: its loss gives per-example
  cross-entropy and an "accuracy" metric (tokens: `losses.next_token`).

  Args:
    name: one of `MODEL_NAMES`.
    kind: the dataset kind, "image" (`{"x": [b, H, W, C], "y": [b]}`) or
      "tokens" (`{"x": int [b, T]}`).
    num_classes: number of labels; required by image models.
    vocab_size: number of token ids; required by token models.
    **overrides: module configuration to change, e.g. `width=8` for
      "resnet18"; see `default_config(name)`.
  """
  spec = _spec(name)
  if kind not in KINDS:
    raise ValueError(f"Unknown dataset kind {kind!r}; choose one of {', '.join(KINDS)}.")
  if kind != spec.kind:
    fits = [n for n in MODEL_NAMES if _SPECS[n].kind == kind]
    raise ValueError(f"model {name!r} needs {_NOUNS[spec.kind]} data; dataset kind is {kind!r} "
                     f"(models for {kind} data: {', '.join(fits)}).")
  size = {"num_classes": num_classes, "vocab_size": vocab_size}[spec.size_arg]
  if size is None or size < 1:
    raise ValueError(f"model {name!r} needs {spec.size_arg} >= 1; got {size}.")
  valid = default_config(name)
  unknown = sorted(set(overrides) - set(valid))
  if unknown:
    raise ValueError(f"Unknown option(s) {unknown} for model {name!r}; valid options: "
                     f"{', '.join(valid)}.")
  module = spec.module(**{spec.size_arg: size}, **overrides)
  task = task_lib.from_linen(module, spec.loss, mask_arg=spec.mask_arg)
  return preprocess.on_device_scaling(task) if kind == "image" else task
