"""The `hetjax` command line: `hetjax train ...` runs one host's part of a job.

Run it once per host (the launchers in `launch/` do that); every host must
get the same arguments. Process 0 writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import traceback
from typing import Sequence

from hetjax.config import Env
from hetjax import config as config_lib  # No JAX: the configs and their checks.
from hetjax import optimizers  # Imports nothing heavy at module level.
from hetjax.config import check_at_least

OPTIMIZERS = optimizers.OPTIMIZERS


class _Parser(argparse.ArgumentParser):
  """argparse, with the fix for a value that starts with '-' (e.g. --assignment -8,56,48)."""

  def error(self, message: str):
    found = re.match(r"argument (\S+?)(/\S+)?: expected one argument", message)
    if found:
      example = "-8,56,48" if found.group(1) == "--assignment" else "VALUE"
      message += (f"; a value that starts with '-' must be joined to its flag with '=', "
                  f"e.g. {found.group(1)}={example}")
    super().error(message)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="hetjax", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
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
                      "(default: only leaves of 2 or more dimensions)")
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
                 help="stop the job (exit 69, restarted under --max-restarts) when no step "
                      "completes for S seconds, naming the stuck host(s) and dumping every "
                      "live host's stacks (default: max(20 x the median step, 300); 0: off)")
  t.add_argument("--model-width", type=int, default=None, help="override the model's width")
  t.add_argument("--dropout", type=float, default=None,
                 help="dropout rate of mlp, cnn and transformer (default 0); keyed per block, "
                      "so the same example gets the same mask on any split")
  from hetjax.modes import options as mode_options  # No JAX: the flags and their checks.
  mode_options.add_arguments(t)
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


def _check_args(args: argparse.Namespace) -> None:
  """Everything that can be checked before JAX starts; raises ValueError."""
  from hetjax import models as zoo
  from hetjax.cli import user_code
  from hetjax.input import data

  if user_code.is_factory(args.model):
    user_code.check_model(args.model, _model_overrides(args))
  elif args.model not in zoo.MODEL_NAMES:
    raise ValueError(f"unknown model {args.model!r}; choose one of {', '.join(zoo.MODEL_NAMES)}, "
                     "or name your own as package.module:factory.")
  if user_code.is_factory(args.dataset):
    user_code.load(args.dataset, "--dataset")
    if args.image_size is not None:
      raise ValueError(f"--image-size decodes TFDS images; --dataset {args.dataset} gives its "
                       "own records, so drop --image-size.")
  else:
    data.check_dataset_name(args.dataset, args.data_dir)
    data.check_image_size(args.dataset, args.image_size)
  if args.image_size is not None:
    from hetjax.input import images
    images.recipe_from_augment(args.image_size, 3, args.augment)
  if args.wandb:
    from hetjax.observe import tracking
    tracking.check_installed()
  if args.data_workers is not None and args.data_workers < 0:
    raise ValueError(f"--data-workers must be >= 0 (0 reads in threads), got {args.data_workers}.")
  optimizers.check(args.optimizer, args.lr, schedule=args.schedule, warmup_steps=args.warmup_steps,
                   total_steps=args.steps, clip_norm=args.clip_norm,
                   weight_decay=args.weight_decay, decay_all=args.decay_all)
  if args.eval_every < 0:
    raise ValueError(f"--eval-every must be >= 0 steps (0: evaluate only at the end), got "
                     f"{args.eval_every}.")
  check_at_least("--steps", args.steps, 1, " (the total, a resumed run does what is left)")
  hosts = os.environ.get(Env.NUM_HOSTS)  # Unset before joining under some launchers.
  hosts = int(hosts) if hosts else None
  _train_config(args).validate(hosts or 1)
  if args.ckpt_dir is not None:
    _checkpoint_config(args).validate()
  from hetjax.modes import options as mode_options
  mode_options.from_args(args, hosts)
  if args.dropout is not None:
    if not 0 <= args.dropout < 1:
      raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}.")
    if not user_code.is_factory(args.model) and "dropout" not in zoo.OPTIONS[args.model]:
      has = zoo.catalog.with_option("dropout")
      raise ValueError(f"model {args.model!r} has no dropout; --dropout applies to "
                       f"{', '.join(has)}.")


def _model_overrides(args: argparse.Namespace) -> dict:
  """--model-width and --dropout, where given, as the model's keywords."""
  given = {"width": args.model_width, "dropout": args.dropout}
  return {k: v for k, v in given.items() if v is not None}


def _load_data(args: argparse.Namespace):
  """(training source, evaluation source or None) of --dataset."""
  from hetjax.cli import user_code
  from hetjax.input import data
  if user_code.is_factory(args.dataset):
    return user_code.load_dataset(args.dataset)
  images = {"image_size": args.image_size} if args.image_size is not None else {}
  source = data.load(args.dataset, "train", data_dir=args.data_dir, augment=args.augment, **images)
  test_source, test_split = None, data.evaluation_split(args.dataset, args.data_dir)
  if source.info.kind == "image" and test_split is not None:
    test_source = data.load(args.dataset, test_split, data_dir=args.data_dir, **images)
  return source, test_source


def _build_task(args: argparse.Namespace, info):
  from hetjax import models as zoo
  from hetjax.cli import user_code
  if user_code.is_factory(args.model):
    return user_code.build_task(args.model, info, _model_overrides(args))
  return zoo.build(args.model, kind=info.kind, num_classes=info.num_classes,
                   vocab_size=info.vocab_size, **_model_overrides(args))


def _checkpoint_config(args: argparse.Namespace) -> config_lib.CheckpointConfig:
  return config_lib.CheckpointConfig(args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep,
                                     resume=args.resume, async_save=args.async_save)


def _train_config(args: argparse.Namespace) -> config_lib.TrainConfig:
  from hetjax import balancer
  assignment = balancer.parse_assignment(args.assignment)
  return config_lib.TrainConfig(
      global_batch=args.global_batch, microbatch=args.microbatch, seed=args.seed,
      assignment=assignment, reduction=args.reduction, balancer=args.balancer,
      precision=args.precision, watchdog_s=args.watchdog,
      device_batch=config_lib.parse_device_batch(args.device_batch),
      device_batch_memory_fraction=args.device_batch_memory_fraction,
      augment="none" if args.image_size is not None else args.augment)  # Else the recipe's.


def _optimizer(args: argparse.Namespace):
  return optimizers.make(args.optimizer, args.lr, schedule=args.schedule,
                         warmup_steps=args.warmup_steps, total_steps=args.steps,
                         clip_norm=args.clip_norm, weight_decay=args.weight_decay,
                         decay_all=args.decay_all)


def _optimizer_identity(args: argparse.Namespace) -> str:
  """The optimizer settings a checkpoint must match to be resumed."""
  identity = (f"{args.optimizer}|{args.lr}|{args.schedule}|{args.warmup_steps}|"
              f"{args.clip_norm}|{args.weight_decay}")
  # Decay of every leaf was the only rule before the mask: its checkpoints
  # resume under --decay-all, and the mask's refuse them, naming this field.
  if optimizers.decays(args.optimizer, args.weight_decay) and not args.decay_all:
    identity += "|decay: leaves of 2+ dimensions"
  return identity


def train(args: argparse.Namespace) -> dict:
  """Runs one host's part of the job; returns the summary."""
  _check_args(args)
  import numpy as np
  from hetjax import trainer
  from hetjax.input import loader
  from hetjax.observe import progress
  from hetjax.cluster import runtime

  topo = runtime.initialize(timeout_s=args.init_timeout)
  images = {"image_size": args.image_size} if args.image_size is not None else {}
  source, test_source = _load_data(args)
  if test_source is not None:
    from hetjax.input import sources
    sources.check_records(test_source, sources.record_spec(source))  # Before, not after, training.
  if args.eval_every and test_source is None:
    raise ValueError(f"--eval-every evaluates on the test split of image datasets; dataset "
                     f"{args.dataset!r} has none here, so drop --eval-every.")
  task = _build_task(args, source.info)
  config = _train_config(args)
  identity = f"{args.model}|{_optimizer_identity(args)}|{args.model_width}|{args.dropout}"
  identity += f"|{args.image_size}|{args.augment}" if images else ""
  ckpt = None if args.ckpt_dir is None else _checkpoint_config(args)
  from hetjax.modes import options as mode_options
  rounds = mode_options.from_args(args, topo.num_hosts)
  if rounds is None:
    tr = trainer.Trainer(task, _optimizer(args), source, config, identity=identity, checkpoint=ckpt,
                         data_workers=args.data_workers if args.data_workers is not None else
                         (loader.default_workers() if images else 0))
  else:  # --mode hybrid / elastic: --steps counts rounds, --optimizer is the inner one.
    from hetjax.modes.rounds_trainer import RoundsTrainer
    tr = RoundsTrainer(task, _optimizer(args), source, config, rounds, identity=identity,
                       checkpoint=ckpt)
  if topo.host_id == 0:  # Only a job that starts writes what re-runs it.
    _write_config(args)
  bar = progress.Progress(args.steps, host_id=topo.host_id, every=max(args.log_every, 1))
  sinks = [bar.update] if args.log_every > 0 else []
  tracked = _tracking(args) if topo.host_id == 0 else None
  sinks += [tracked] if tracked is not None else []
  try:
    summary = tr.fit(until=args.steps, sinks=sinks, out=args.out, eval_source=test_source,
                     eval_every=args.eval_every)
  except BaseException:
    if tracked is not None:
      tracked.run.finish(exit_code=1)
    raise
  finally:
    bar.close()
  tr.close()
  summary.update(model=args.model, dataset=args.dataset, optimizer=args.optimizer, lr=args.lr,
                 schedule=args.schedule, warmup_steps=args.warmup_steps, clip_norm=args.clip_norm,
                 weight_decay=args.weight_decay, decay_all=args.decay_all, seed=args.seed,
                 command=shlex.join(sys.argv),
                 params_digest=trainer.params_digest(tr.params()))
  if summary.get("eval"):
    summary["test_accuracy"] = summary["eval"].get("accuracy")
    summary["test_loss"] = summary["eval"]["loss"]
  tr.write_summary(args.out, summary)
  if topo.host_id == 0:
    if args.save_params:
      import jax
      flat = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_leaves_with_path(tr.params())}
      np.savez(args.save_params, **flat)
  if tracked is not None:
    tracked.finish(summary, _report_picture(args.out))
  return summary


def _tracking(args: argparse.Namespace):
  """Host 0's W&B run for --wandb (None without it)."""
  if not args.wandb:
    return None
  from hetjax.observe import tracking
  return tracking.WandbRun(args.wandb, resolved_config(args), args.out,
                           name=os.path.basename(os.path.normpath(args.out)))


def _report_picture(out: str) -> str | None:
  """OUT/report.png drawn now (what `hetjax report OUT` draws); None if the run is too short."""
  from hetjax.observe import report
  try:
    report.make_report(out)
  except ValueError:
    return None
  return os.path.join(out, report.PNG_FILE)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line, with `train --config FILE` read in first so that flags override it.

  A bad config file is a usage error (exit 2) worded as a bad flag is.
  """
  parser = _parser()
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.command == "train" and args.config:
    from hetjax.cli import config_file
    train_parser = _train_parser(parser)
    try:
      from_file = config_file.to_argv(args.config, train_parser)
    except ValueError as e:
      train_parser.error(str(e))
    at = argv.index("train") + 1
    args = parser.parse_args(argv[:at] + from_file + argv[at:])
  return args


def _train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  return sub.choices["train"]


def resolved_config(args: argparse.Namespace) -> dict:
  """Every `hetjax train` flag's value, as OUT/config.yaml holds it."""
  from hetjax.cli import config_file
  return config_file.resolved(args, _train_parser(_parser()))


def _write_config(args: argparse.Namespace) -> None:
  """OUT/config.yaml: `hetjax train --config OUT/config.yaml` runs this job again."""
  from hetjax.cli import config_file
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, config_file.CONFIG_FILE), "w") as f:
    f.write(config_file.dump(resolved_config(args), head=True))


def _print_summary(summary: dict) -> None:
  """The end of a run in a few lines; a rounds run says which figures are per round."""
  rounds = summary.get("mode") in ("hybrid", "elastic")
  # name shown -> summary key; in rounds modes global_batch is one local step over all hosts.
  keys = {"steps": "steps", "global_batch": "global_batch", "hosts": "hosts",
          "samples_per_sec": "samples_per_sec", "final_loss": "final_loss",
          "test_accuracy": "test_accuracy", "params_digest": "params_digest"}
  if rounds:
    keys = {"mode": "mode", "rounds": "steps", "samples_per_local_step": "global_batch",
            **{k: v for k, v in keys.items() if k not in ("steps", "global_batch")}}
  print("summary: " + json.dumps({k: summary[v] for k, v in keys.items() if v in summary}))
  per = "/round" if rounds else "/step"
  for i, host in enumerate(summary["per_host"]):
    if not host["compute_s"] or not host["wait_s"]:
      continue  # A resumed run that had nothing left to do.
    c, w = host["compute_s"][2:] or host["compute_s"], host["wait_s"][2:] or host["wait_s"]
    work = (f"{host['batch'][-1]:4d} samples{per}" +
            (f" ({host['tau'][-1]} local steps)" if rounds and host.get("tau") else ""))
    print(f"  host {i}: {work}  compute {sum(c) / len(c) * 1e3:7.1f} ms{per}  "
          f"wait {sum(w) / len(w) * 1e3:7.1f} ms{per}"
          + ("  (emulated speeds)" if summary["emulated_speeds"] else ""))


def _check_args_or_exit(args: argparse.Namespace) -> None:
  """--print-config shows only a configuration that would run."""
  try:
    _check_args(args)
  except ValueError as e:
    _train_parser(_parser()).error(str(e))


def _exit_now(code: int) -> None:
  """Leaves at once: JAX's exit-time shutdown would wait for the other hosts."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.command == "train" and args.print_config:
    from hetjax.cli import config_file
    _check_args_or_exit(args)
    print(config_file.dump(resolved_config(args)), end="")
    return 0
  if args.command in ("report", "doctor"):
    from hetjax.cluster import doctor
    from hetjax.observe import report
    return {"report": report, "doctor": doctor}[args.command].run(args)
  # Read when needed, not up front: joining a cluster found from SLURM or
  # Open MPI writes HETJAX_NUM_HOSTS / HETJAX_HOST_ID (hetjax.cluster.runtime).
  multi_host = lambda: config_lib.num_hosts_from_env() > 1
  from hetjax.cluster import signals  # Stdlib only: bad arguments still fail before JAX loads.
  try:
    # Caught from the start: a signal while joining or compiling stops this host
    # at once (exit 75 / 130) instead of being swallowed by JAX's SIGTERM handler;
    # inside the step loop it waits for the boundary every host agrees on.
    with signals.REQUESTS.installed(defer=False):
      summary = train(args)
  except (ValueError, ConnectionError) as e:
    print(f"hetjax {args.command}: error: {e}", file=sys.stderr)
    if multi_host():
      _exit_now(2)
    return 2
  except signals.Stopped as e:
    print(f"hetjax {args.command}: {e}", file=sys.stderr)
    _exit_now(e.exit_code)
  except KeyboardInterrupt:  # A second Ctrl-C inside the step loop.
    print(f"hetjax {args.command}: interrupted (Ctrl-C) before a step boundary; nothing saved.",
          file=sys.stderr)
    _exit_now(signals.INTERRUPTED_EXIT)
  except BaseException as e:
    if type(e).__name__ == "HostsDisagree":  # Not imported up front: it pulls in JAX.
      print(f"hetjax {args.command}: error: {e}", file=sys.stderr)
      _exit_now(1)
    if not multi_host():
      raise
    traceback.print_exc()
    _exit_now(1)
  if summary and config_lib.host_id_from_env() == 0:
    _print_summary(summary)
  return 0

