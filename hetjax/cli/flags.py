"""`hetjax train`'s flags and config-file keys, generated from the configs' fields.

One table, `FIELDS`: every field of the configs (`hetjax.config`, `JobConfig`)
is a config-file key, its name with dashes; those `GROUPS` names are also
flags, on `--help` in that order (the rest are the expert's). Help is the
field's `Args:` entry in its class's docstring. No JAX here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import inspect
import re
from typing import Any, Iterator, NamedTuple

from hetjax import config as config_lib  # No JAX: the configs and their checks.
from hetjax import optimizers  # Imports nothing heavy at module level.


@dataclasses.dataclass(frozen=True)
class JobConfig:
  """What `hetjax train` sets around the library's configs: model, data, optimizer, files.

  Args:
    model: mlp, cnn, resnet18, resnet50, transformer, or package.module:factory returning
      a hetjax.Task (docs/model.md).
    dataset: digits, synthetic, synthetic_big, tokens, tokenfile:PATH (flat token ids),
      tfds:NAME (in `data_dir`), or package.module:factory returning (train, eval) sources.
    data_dir: the TFDS data folder for tfds:NAME.
    image_size: decode TFDS images and crop/resize them to S x S on the input workers.
    seq_len: token datasets: tokens per record (tokenfile:PATH needs it).
    token_dtype: tokenfile:PATH's ids: uint16 (nanoGPT's .bin) or uint32.
    vocab_size: token datasets: the vocabulary (tokenfile: default the largest id + 1).
    data_workers: input worker processes (default: cores - 1 with `image_size`; 0: threads).
    steps: steps (rounds, in a rounds mode) in all; a resumed run does what is left.
    optimizer: the (inner) optimizer: sgd, momentum, adam or adamw.
    lr: the peak learning rate.
    schedule: the learning rate over optimizer updates, after the warm-up.
    warmup_steps: updates of linear learning-rate warm-up from 0.
    clip_norm: clip gradients to this global norm (default: no clipping).
    weight_decay: decoupled weight decay of kernels and embeddings (adam becomes adamw).
    decay_all: weight decay reaches every leaf, biases and normalisation scales too.
    eval_every: evaluate on the test split every N steps (0: only at the end).
    out: the run folder: summary.json, metrics.jsonl, config.yaml and tensorboard/ (host 0).
    wandb: log to Weights & Biases project PROJECT from host 0 (pip install 'hetjax[wandb]').
    save_params: write the final parameters to this .npz file (host 0).
    log_every: a progress line every N steps when not on a terminal (0: none).
    init_timeout: seconds to reach the coordinator (default HETJAX_INIT_TIMEOUT or 120).
    model_width: override the built-in model's width.
    dropout: dropout rate of mlp, cnn and transformer (default 0), keyed per block.
  """

  model: str = "cnn"
  dataset: str = "digits"
  data_dir: str | None = None
  image_size: int | None = None
  seq_len: int | None = None
  token_dtype: str = "uint16"
  vocab_size: int | None = None
  data_workers: int | None = None
  steps: int = 100
  optimizer: str = "adam"
  lr: float = 1e-3
  schedule: str = "constant"
  warmup_steps: int = 0
  clip_norm: float | None = None
  weight_decay: float | None = None
  decay_all: bool = False
  eval_every: int = 0
  out: str = "runs/latest"
  wandb: str | None = None
  save_params: str | None = None
  log_every: int = 10
  init_timeout: float | None = None
  model_width: int | None = None
  dropout: float | None = None


MODES_GROUP = "modes (hybrid: local SGD across hosts; elastic: EASGD rounds)"
# The flags, by `--help` group, in order; every other field is a config-file key only.
GROUPS = (
    ("start here", ("model", "dataset", "global_batch", "microbatch", "steps", "optimizer",
                    "lr", "balancer", "mode", "out")),
    ("data", ("data_dir", "augment", "image_size", "seq_len", "token_dtype", "vocab_size")),
    ("training", ("precision", "schedule", "warmup_steps", "clip_norm", "weight_decay",
                  "eval_every", "assignment", "device_batch", "shard_within_host")),
    ("the run", ("log_every", "wandb", "watchdog_s")),
    (MODES_GROUP, ("round_steps", "local_steps", "local_batch", "outer_optimizer", "outer_lr",
                   "outer_momentum", "elastic_beta")),
    ("checkpoints (orbax; the folder must be shared by all hosts)", ("directory", "every")),
)
# The configs, with the config-file section their keys are written in (None: top level).
_CLASSES = ((JobConfig, None), (config_lib.TrainConfig, None), (config_lib.RoundsConfig, "modes"),
            (config_lib.CheckpointConfig, "checkpoints"))
_KEYS = {"watchdog_s": "watchdog", "directory": "ckpt-dir", "every": "ckpt-every",
         "keep": "ckpt-keep"}  # Fields whose key is not their name with dashes.
CHOICES = {"precision": config_lib.PRECISIONS, "balancer": config_lib.BALANCERS,
            "mode": config_lib.MODES, "schedule": optimizers.SCHEDULES,
            "token_dtype": ("uint16", "uint32"), "reduction": config_lib.REDUCTIONS,
            "update_layout": config_lib.UPDATE_LAYOUTS}
_DEFAULTS = {"global_batch": 64, "mode": "sync"}  # The command's, where the field has none.
# A rounds setting's flag applies to these modes (default: both); unset, it is None.
_APPLIES = {"outer_optimizer": ("hybrid",), "outer_lr": ("hybrid",),
            "outer_momentum": ("hybrid",), "elastic_beta": ("elastic",)}


class Field(NamedTuple):
  """One config field as the command line and config files see it."""

  name: str             # the dataclass field
  owner: type           # its dataclass
  key: str              # the config file's key; the flag is --key
  kind: type            # int, float, str or bool (a switch)
  default: Any
  help: str
  group: str | None     # its `--help` group; None: a config-file key only
  section: str | None   # its config-file section; None: the top level

  @property
  def dest(self) -> str:
    """Its attribute on the parsed arguments."""
    return self.key.replace("-", "_")

  @property
  def flag(self) -> str:
    return "--" + self.key


def _docs(cls: type) -> dict[str, str]:
  """Each field's entry under `Args:` in `cls`'s docstring, on one line."""
  out, names = {}, []
  for line in inspect.getdoc(cls).split("Args:\n", 1)[1].splitlines():
    if not line.startswith("  "):
      break
    head = re.match(r"  (\w+(?:, \w+)*): (.*)", line)
    names = head.group(1).split(", ") if head else names
    for name in names:
      out[name] = (out.get(name, "") + " " + (head.group(2) if head else line.strip())).strip()
  return out


def _kind(annotation: str) -> type:
  return {"int": int, "float": float, "bool": bool}.get(annotation.replace(" | None", ""), str)


def _fields() -> tuple[Field, ...]:
  group_of = {name: title for title, names in GROUPS for name in names}
  out = []
  for cls, section in _CLASSES:
    docs = _docs(cls)
    for f in dataclasses.fields(cls):
      default = (None if cls is config_lib.RoundsConfig or f.default is dataclasses.MISSING
                 else f.default)  # A rounds flag is None unless given: see `rounds_config`.
      kind, default = _kind(f.type), _DEFAULTS.get(f.name, default)
      default = str(default) if kind is str and default is not None else default  # 1 -> '1'
      out.append(Field(f.name, cls, _KEYS.get(f.name, f.name.replace("_", "-")), kind, default,
                       docs[f.name], group_of.get(f.name), section))
  order = [name for _, names in GROUPS for name in names]  # The flags first, as on --help.
  return tuple(sorted(out, key=lambda f: order.index(f.name) if f.name in order else len(order)))


FIELDS = _fields()
BY_NAME = {f.name: f for f in FIELDS}
BY_KEY = {f.key: f for f in FIELDS}
# A field's name, and its attribute where that differs -> how a command-line user sees it.
_WORDING = {n: f.flag if f.group else f"`{f.key}`" for f in FIELDS for n in {f.name, f.dest}}


def as_flags(text: str) -> str:
  """`text` with each backticked config field replaced by its flag (or config key).

  Example:
    >>> as_flags("`global_batch` must be >= 1, got 0.")
    '--global-batch must be >= 1, got 0.'
  """
  return re.sub(r"`(\w+)`", lambda m: _WORDING.get(m.group(1), m.group(0)), text)


@contextlib.contextmanager
def worded_as_flags() -> Iterator[None]:
  """Re-raises a ValueError from inside with its fields worded as flags (`as_flags`)."""
  try:
    yield
  except ValueError as e:
    raise ValueError(as_flags(str(e))) from None


class Parser(argparse.ArgumentParser):
  """argparse, with the fix for a value that starts with '-' (e.g. --assignment -8,56,48)
  and for a config-file key typed as a flag."""

  def error(self, message: str):
    found = re.match(r"argument (\S+?)(/\S+)?: expected one argument", message)
    if found:
      example = "-8,56,48" if found.group(1) == "--assignment" else "VALUE"
      message += (f"; a value that starts with '-' must be joined to its flag with '=', "
                  f"e.g. {found.group(1)}={example}")
    unknown = re.search(r"unrecognized arguments: --([\w-]+)", message)
    field = BY_KEY.get(unknown.group(1)) if unknown else None
    if field is not None:
      where = f"under `{field.section}:` " if field.section else ""
      message += (f"; {field.key} is a config-file key, not a flag: write '{field.key}: ...' "
                  f"{where}in a file given to --config")
    elif unknown:
      near = difflib.get_close_matches(unknown.group(1), list(BY_KEY), n=1)
      message += f" (did you mean --{near[0]}?)" if near and BY_KEY[near[0]].group else ""
    super().error(message)


def _add(group: argparse._ArgumentGroup, field: Field) -> None:  # pylint: disable=protected-access
  text = as_flags(field.help).replace("`", "").replace("%", "%%")
  if field.kind is bool:
    group.add_argument(field.flag, dest=field.dest, action="store_true", help=text)
    return
  metavar = {int: "N", float: "X"}.get(field.kind, field.key.split("-")[-1].upper())
  group.add_argument(field.flag, dest=field.dest, type=field.kind, default=field.default,
                     choices=CHOICES.get(field.name), metavar=None if field.name in CHOICES
                     else metavar, help=text)


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
  """`--mode` and the rounds settings alone (what `rounds_config` reads)."""
  g = p.add_argument_group(MODES_GROUP)
  for name in ("mode",) + dict(GROUPS)[MODES_GROUP]:
    _add(g, BY_NAME[name])


def parser() -> argparse.ArgumentParser:
  """The whole command line: `train`, `report` and `doctor` with their flags (no JAX)."""
  p = Parser(prog="hetjax", description="The `hetjax` command line: `hetjax train ...` runs "
             "one host's part of a job.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
  t = sub.add_parser("train", help="train a built-in model, or your own, on a dataset",
                     epilog="Every setting is also a config-file key, the flag without '--' "
                     "(docs/cli.md lists the keys that have no flag).")
  for title, names in GROUPS:
    g = t.add_argument_group(title)
    if title == "start here":
      g.add_argument("--config", default=None, metavar="FILE.yaml",
                     help="read settings from a YAML file (keys: the long flag names, e.g. "
                          "'global-batch: 64'); flags override it; a run's OUT/config.yaml "
                          "re-runs it")
      g.add_argument("--print-config", action="store_true",
                     help="print the resolved configuration as YAML and exit")
    for name in names:
      _add(g, BY_NAME[name])
  t.set_defaults(**{f.dest: f.default for f in FIELDS if f.group is None})
  from hetjax.cluster import doctor  # Neither imports JAX at module level.
  from hetjax.observe import report
  report.add_arguments(sub.add_parser("report", help="draw and summarise a run folder"))
  doctor.add_arguments(sub.add_parser(
      "doctor", help="check the cluster and measure every host (run it on every host)"))
  return p


def train_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """The `train` command's parser inside `p`."""
  sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  return sub.choices["train"]


def config_of(cls: type, args: argparse.Namespace, **values: Any) -> Any:
  """The `cls` config (`TrainConfig`, `CheckpointConfig`) of the parsed arguments; `values`
  replace fields."""
  return cls(**{**{f.name: getattr(args, f.dest) for f in FIELDS if f.owner is cls}, **values})


def rounds_config(args: argparse.Namespace,
                  num_hosts: int | None = None) -> config_lib.RoundsConfig | None:
  """The `RoundsConfig` of `--mode` and its settings (None for sync); raises ValueError
  worded as flags. A setting given to a mode it does not apply to is refused: a silently
  ignored `--elastic-beta` is a wrong experiment."""
  rounds = [f for f in FIELDS if f.owner is config_lib.RoundsConfig and f.name != "mode"]
  given = {f.name: getattr(args, f.dest) for f in rounds if getattr(args, f.dest, None) is not None}
  wrong = [k for k in given if args.mode not in _APPLIES.get(k, ("hybrid", "elastic"))]
  with worded_as_flags():
    if wrong:
      modes = _APPLIES.get(wrong[0], ("hybrid", "elastic"))
      raise ValueError(f"`{wrong[0]}` does not apply to `mode` {args.mode}; it is for `mode` "
                       f"{' or '.join(modes)}. Drop it, or choose that mode.")
    if args.mode == "sync":
      return None
    if getattr(args, "data_workers", None) is not None:
      raise ValueError(f"`data_workers` does not apply to `mode` {args.mode}: a round reads its "
                       "records in the training thread.")
    if "local_steps" in given:
      text = given["local_steps"]
      try:
        given["local_steps"] = tuple(int(t) for t in text.split(","))
      except ValueError:
        raise ValueError(f"--local-steps {text!r} must be comma-separated whole numbers, one "
                         "per host, e.g. 4,2,1.") from None
    config = config_lib.RoundsConfig(mode=args.mode, **given)
    config.check_split(getattr(args, "balancer", None), getattr(args, "assignment", "equal"),
                       getattr(args, "shard_within_host", None) or "off")
    config.validate(num_hosts, getattr(args, "global_batch", None))
  return config
