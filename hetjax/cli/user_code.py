"""`--model package.module:factory` and `--dataset package.module:factory`: your own code on the CLI.

A model factory returns a `hetjax.Task`, called with the keywords it names
among `num_classes`, `vocab_size`, `kind`, `width` and `dropout` (all known
ones for `**kwargs`). A dataset factory takes nothing and returns
`(train_source, eval_source or None)` or one source, each with `len()`,
`source[indices]` and `.info`, e.g. `hetjax.ArraySource`. Both are checked
before JAX starts (imported, signature read, nothing called); the current
folder is searched first, as `python -m` does.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Any, Callable

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_FIELD_OF = {"width": "`model_width`", "dropout": "`dropout`"}  # Worded by the caller.


def is_factory(name: str) -> bool:
  """Whether a --model / --dataset value names user code (`module:function`), not a built-in."""
  return bool(_SPEC.match(name)) and not name.startswith("tfds:")


def load(spec: str, flag: str) -> Callable[..., Any]:
  """The function `package.module:name` names; raises ValueError saying what is missing."""
  module_name, _, attr = spec.partition(":")
  if os.getcwd() not in sys.path and "" not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    raise ValueError(f"{flag} {spec}: cannot import module {module_name!r} ({e}); run from the "
                     "folder that holds it, or add that folder to PYTHONPATH.") from None
  target: Any = module
  for part in attr.split("."):
    if not hasattr(target, part):
      public = sorted(n for n in dir(module) if not n.startswith("_")
                      and callable(getattr(module, n)))
      raise ValueError(f"{flag} {spec}: module {module_name!r} has no {attr!r}; its functions: "
                       f"{', '.join(public) or 'none'}.")
    target = getattr(target, part)
  if not callable(target):
    raise ValueError(f"{flag} {spec}: {attr!r} is a {type(target).__name__}, not a function "
                     "returning " + ("a hetjax.Task." if flag == "--model" else "sources."))
  return target


def _named(fn: Callable[..., Any]) -> tuple[set[str], bool]:
  """The keyword names `fn` takes, and whether it takes **kwargs."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return set(), True
  return ({p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)},
          any(p.kind == p.VAR_KEYWORD for p in params))


def check_model(spec: str, overrides: dict[str, Any]) -> None:
  """Refuses, before JAX starts, a factory that cannot take the flags given for it."""
  names, anything = _named(load(spec, "--model"))
  for key in overrides:
    if not anything and key not in names:
      raise ValueError(f"{_FIELD_OF[key]} was given but --model {spec} takes no {key!r} "
                       f"keyword; add {key}=... to its signature, or drop the setting.")


def build_task(spec: str, info: Any, overrides: dict[str, Any]) -> Any:
  """Calls the model factory with the keywords it names; checks it returned a Task."""
  from hetjax import task as task_lib

  fn = load(spec, "--model")
  names, anything = _named(fn)
  known = {"num_classes": info.num_classes, "vocab_size": info.vocab_size, "kind": info.kind,
           **overrides}
  kwargs = {k: v for k, v in known.items() if (anything and v is not None) or k in names}
  task = fn(**kwargs)
  if not isinstance(task, task_lib.Task):
    raise ValueError(f"--model {spec} returned a {type(task).__name__}, not a hetjax.Task; wrap "
                     "the model with hetjax.from_functions, from_linen or from_nnx.")
  return task


def load_dataset(spec: str) -> tuple[Any, Any]:
  """`(train_source, eval_source or None)` from a dataset factory, each checked for `.info`."""
  made = load(spec, "--dataset")()
  train, test = made if isinstance(made, tuple) else (made, None)
  for name, source in (("training", train), ("evaluation", test)):
    if source is None and name == "evaluation":
      continue
    missing = [a for a in ("info", "__len__", "__getitem__") if not hasattr(source, a)]
    if missing:
      raise ValueError(f"--dataset {spec} returned a {name} source of type "
                       f"{type(source).__name__} without {', '.join(missing)}; return e.g. "
                       "hetjax.ArraySource({'x': x, 'y': y}, hetjax.DatasetInfo(...)).")
  return train, test
