"""The command line's flags, and config errors worded as flags.

`parser()` builds every command's flags (cheap: no JAX, no model zoo);
`as_flags` is the one place where a config's message, which names its
dataclass fields in backticks as the Python API spells them (`global_batch`,
`hetjax.config`), is reworded with the flags a command-line user typed
(`--global-batch`).
"""

from __future__ import annotations

import argparse
import contextlib
import re
from typing import Iterator

from hetjax import config as config_lib  # No JAX: the configs and their checks.
from hetjax import optimizers  # Imports nothing heavy at module level.

OPTIMIZERS = optimizers.OPTIMIZERS
# Config fields whose flag is not the field's name with dashes.
_FIELD_FLAGS = {"watchdog_s": "--watchdog", "every": "--ckpt-every", "keep": "--ckpt-keep",
                "directory": "--ckpt-dir"}


class Parser(argparse.ArgumentParser):
  """argparse, with the fix for a value that starts with '-' (e.g. --assignment -8,56,48)."""

  def error(self, message: str):
    found = re.match(r"argument (\S+?)(/\S+)?: expected one argument", message)
    if found:
      example = "-8,56,48" if found.group(1) == "--assignment" else "VALUE"
      message += (f"; a value that starts with '-' must be joined to its flag with '=', "
                  f"e.g. {found.group(1)}={example}")
    super().error(message)


def parser() -> argparse.ArgumentParser:
  """The whole command line: `train`, `report` and `doctor` with their flags (no JAX)."""
  p = Parser(prog="hetjax", description="The `hetjax` command line: `hetjax train ...` runs one host's part of a job.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
  t = sub.add_parser("train", help="train a built-in model, or your own, on a dataset")
  t.add_argument("--config", default=None, metavar="FILE.yaml",
                 help="read flags from a YAML file (keys: the long flag names, e.g. "
                      "'global-batch: 64'); flags on the command line override it; every run "
                      "writes its resolved OUT/config.yaml, which re-runs the job")
  t.add_argument("--print-config", action="store_true",
                 help="print the resolved configuration as YAML and exit")
  t.add_argument("--model", default="cnn",
                 help="mlp, cnn, resnet18, resnet50, transformer, or package.module:factory, a "
                      "function returning a hetjax.Task (it gets the keywords it names among "
                      "num_classes, vocab_size, kind, width (--model-width), dropout (--dropout))")
  t.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                 help="compute type; parameters and gradient sums stay float32 (fp16: loss scaling)")
  t.add_argument("--dataset", default="digits",
                 help="digits, synthetic, synthetic_big, tokens, tfds:NAME (prepared in "
                      "--data-dir), or package.module:factory, a function returning "
                      "(train_source, eval_source or None), each with .info (hetjax.DatasetInfo)")
  t.add_argument("--data-dir", default=None, help="TFDS data folder for --dataset tfds:NAME")
  t.add_argument("--augment", default="none", help="none, crop, flip or crop,flip (images)")
  t.add_argument("--image-size", type=int, default=None, metavar="S",
                 help="decode TFDS images (any size, JPEG/PNG) and crop/resize them to S x S on "
                      "the input workers; --augment crop,flip gives the random resized crop")
  t.add_argument("--data-workers", type=int, default=None, metavar="N",
                 help="input worker processes on this host (default: its cores minus one with "
                      "--image-size, else 0; 0 reads in threads)")
  t.add_argument("--global-batch", type=int, default=64, help="samples per step over all hosts")
  t.add_argument("--steps", type=int, default=100)
  t.add_argument("--optimizer", default="adam", help=", ".join(OPTIMIZERS))
  t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
  t.add_argument("--schedule", default="constant", choices=optimizers.SCHEDULES,
                 help="learning rate over optimizer updates, after the warm-up")
  t.add_argument("--warmup-steps", type=int, default=0,
                 help="updates of linear learning-rate warm-up from 0")
  t.add_argument("--clip-norm", type=float, default=None,
                 help="clip gradients to this global norm (default: no clipping)")
  t.add_argument("--weight-decay", type=float, default=None,
                 help="decoupled weight decay (adam becomes adamw; default: none, adamw 1e-4) "
                      "of the kernels and embeddings, not of biases and normalisation scales")
  t.add_argument("--decay-all", action="store_true",
                 help="weight decay reaches every leaf, biases and normalisation scales too "
                      "(default: kernels and embeddings, by their Flax names)")
  t.add_argument("--eval-every", type=int, default=0,
                 help="evaluate on the test split every N steps, spread over every host "
                 "(0: only at the end)")
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--assignment", default="equal",
                 help="'equal' or one share per host summing to the global batch, each a whole "
                      "number of --microbatch blocks, e.g. 4,24,36")
  t.add_argument("--balancer", default=None, choices=("equal", "static", "dynamic"),
                 help="size shares from measured step times (default: follow --assignment)")
  t.add_argument("--microbatch", type=int, default=16,
                 help="samples per block: the unit of the math (a BatchNorm group, a dropout "
                      "key) and of balancing")
  t.add_argument("--device-batch", default="1", metavar="K[,K...]|auto",
                 help="blocks per device in a host's largest micro-batch: one per host (e.g. "
                      "16,8,2), one for all, or 'auto' (from each device's memory and speed); "
                      "the blocks stay separate, so the math is that of 1")
  t.add_argument("--device-batch-memory-fraction", type=float, default=0.8, metavar="F",
                 help="the share of a device's memory --device-batch auto may fill")
  t.add_argument("--reduction", default="device", choices=("device", "host"),
                 help="cross-host reduction backend")
  t.add_argument("--update-layout", default="auto", choices=config_lib.UPDATE_LAYOUTS,
                 help="the sharded update's optimizer layout: auto (probe: slices for an "
                      "element-wise optimizer, whole leaves otherwise), whole, or sliced "
                      "(refuse an optimizer that needs whole leaves)")
  t.add_argument("--shard-within-host", default="off", metavar="auto|on|off[,...]",
                 help="keep a host's parameters and gradient sums split over its own devices, "
                      "gathered where used: off (default), on, auto (only where the whole "
                      "state does not fit the device), or one per host (off,off,on); the math "
                      "and what crosses hosts do not change")
  t.add_argument("--device-memory", type=float, default=None, metavar="GB",
                 help="a device's memory for --shard-within-host auto where the backend "
                      "reports none (XLA:CPU): an emulated limit")
  t.add_argument("--out", default="runs/latest",
                 help="folder for summary.json, metrics.jsonl and tensorboard/ (host 0)")
  t.add_argument("--wandb", default=None, metavar="PROJECT",
                 help="log to Weights & Biases project PROJECT from host 0: the resolved config, "
                      "every metrics record, the summary and the report picture (needs "
                      "pip install 'hetjax[wandb]'; WANDB_MODE=offline works)")
  t.add_argument("--save-params", default=None, metavar="FILE.npz",
                 help="write the final parameters (host 0)")
  t.add_argument("--log-every", type=int, default=10,
                 help="progress line every N steps when not on a terminal (0: none)")
  t.add_argument("--init-timeout", type=float, default=None,
                 help="seconds to reach the coordinator (default HETJAX_INIT_TIMEOUT or 120)")
  t.add_argument("--watchdog", type=float, default=None, metavar="S",
                 help="stop the job (exit 69, restarted under --max-restarts) when a wait on the "
                      "other hosts makes no progress for its deadline: S for a step, 3 x S for "
                      "evaluation, checkpoints and agreement checks, 10 x S for building and the "
                      "first steps; names the stuck host(s) and dumps every live host's stacks "
                      "(default S: max(20 x the median step, 300); 0: off)")
  t.add_argument("--model-width", type=int, default=None, help="override the model's width")
  t.add_argument("--dropout", type=float, default=None,
                 help="dropout rate of mlp, cnn and transformer (default 0); keyed per block, "
                      "so the same example gets the same mask on any split")
  from hetjax.cli import mode_flags  # It words its errors with `as_flags`, from here.
  mode_flags.add_arguments(t)
  c = t.add_argument_group("checkpoints (orbax; the folder must be shared by all hosts)")
  c.add_argument("--ckpt-dir", default=None,
                 help="save checkpoints here and resume from the newest one found there")
  c.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
  c.add_argument("--ckpt-keep", type=int, default=3, help="how many checkpoints to keep")
  c.add_argument("--no-resume", dest="resume", action="store_false",
                 help="start afresh even if --ckpt-dir holds a checkpoint")
  c.add_argument("--sync-save", dest="async_save", action="store_false",
                 help="block training while a checkpoint is written (default: background)")
  from hetjax.cluster import doctor  # Neither imports JAX at module level.
  from hetjax.observe import report
  report.add_arguments(sub.add_parser("report", help="draw and summarise a run folder"))
  doctor.add_arguments(sub.add_parser(
      "doctor", help="check the cluster and measure every host (run it on every host)"))
  return p



def train_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """The `train` command's parser inside `p` (what a config file's keys are checked against)."""
  sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  return sub.choices["train"]


def _train_flags() -> dict[str, str]:
  """Field or dest name -> its long flag, for every `train` flag."""
  flags = {}
  for action in train_parser(parser())._actions:  # pylint: disable=protected-access
    longs = [o for o in action.option_strings if o.startswith("--")]
    if longs:
      flags[action.dest] = longs[0]
  return {**flags, **_FIELD_FLAGS}


def as_flags(text: str) -> str:
  """`text` with each backticked config field that has a flag replaced by the flag.

  Example:
    >>> as_flags("`global_batch` must be >= 1, got 0.")
    '--global-batch must be >= 1, got 0.'
  """
  flags = _train_flags()
  return re.sub(r"`(\w+)`", lambda m: flags.get(m.group(1), m.group(0)), text)


@contextlib.contextmanager
def worded_as_flags() -> Iterator[None]:
  """Re-raises a ValueError from inside with its fields worded as flags (`as_flags`)."""
  try:
    yield
  except ValueError as e:
    raise ValueError(as_flags(str(e))) from None
