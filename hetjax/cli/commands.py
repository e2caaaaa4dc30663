"""The `hetjax` command line: `hetjax train ...` runs one host's part of a job.

Run it once per host (the launchers in `launch/` do that); every host must
get the same arguments. Process 0 writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import traceback
from typing import Sequence

from hetjax import config as config_lib  # No JAX: the configs and their checks.
from hetjax import exits, optimizers  # Neither imports anything heavy at module level.
from hetjax.cli import flags, user_code  # Stdlib only.
from hetjax.config import Env, check_at_least


@flags.worded_as_flags()
def _check_args(args: argparse.Namespace) -> None:
  """Everything that can be checked before JAX starts; raises ValueError worded as flags."""
  from hetjax import models as zoo
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
    data.check_dataset_name(args.dataset, args.data_dir, **_tokens(args))
    data.check_image_size(args.dataset, args.image_size)
  if args.image_size is not None:
    from hetjax.input import images
    images.recipe_from_augment(args.image_size, 3, args.augment)
  if args.wandb:
    from hetjax.observe import tracking
    tracking.check_installed()
  if args.data_workers is not None:
    check_at_least("`data_workers`", args.data_workers, 0, " (0 reads in threads)")
  optimizers.check(args.optimizer, args.lr, **_optimizer_settings(args))
  check_at_least("--eval-every", args.eval_every, 0, " steps (0: evaluate only at the end)")
  check_at_least("--steps", args.steps, 1, " (the total, a resumed run does what is left)")
  hosts = int(os.environ.get(Env.NUM_HOSTS) or 0) or None  # Unset before joining: some launchers.
  _train_config(args).validate(hosts or 1)
  if args.ckpt_dir is not None:
    _checkpoint_config(args).validate()
  flags.rounds_config(args, hosts)
  if args.dropout is not None:
    if not 0 <= args.dropout < 1:
      raise ValueError(f"`dropout` must be in [0, 1), got {args.dropout}.")
    if not user_code.is_factory(args.model) and "dropout" not in zoo.OPTIONS[args.model]:
      has = zoo.catalog.with_option("dropout")
      raise ValueError(f"model {args.model!r} has no dropout; `dropout` applies to "
                       f"{', '.join(has)}.")


def _tokens(args: argparse.Namespace) -> dict:
  """--seq-len, --token-dtype and --vocab-size as `hetjax.input.data.load`'s keywords."""
  return {"seq_len": args.seq_len, "token_dtype": args.token_dtype, "vocab_size": args.vocab_size}


def _model_overrides(args: argparse.Namespace) -> dict:
  """`model_width` and `dropout`, where given, as the model's keywords."""
  given = {"width": args.model_width, "dropout": args.dropout}
  return {k: v for k, v in given.items() if v is not None}


def _load_data(args: argparse.Namespace):
  """(training source, evaluation source or None) of --dataset."""
  from hetjax.input import data
  if user_code.is_factory(args.dataset):
    return user_code.load_dataset(args.dataset)
  images = {"image_size": args.image_size} if args.image_size is not None else {}
  source = data.load(args.dataset, "train", data_dir=args.data_dir, augment=args.augment,
                     **images, **_tokens(args))
  test_source, test_split = None, data.evaluation_split(args.dataset, args.data_dir)
  if source.info.kind == "image" and test_split is not None:
    test_source = data.load(args.dataset, test_split, data_dir=args.data_dir, **images,
                            **_tokens(args))
  return source, test_source


def _checkpoint_config(args: argparse.Namespace) -> config_lib.CheckpointConfig:
  return flags.config_of(config_lib.CheckpointConfig, args)


def _train_config(args: argparse.Namespace) -> config_lib.TrainConfig:
  from hetjax import balancer
  return flags.config_of(
      config_lib.TrainConfig, args, assignment=balancer.parse_assignment(args.assignment),
      device_batch=config_lib.parse_device_batch(args.device_batch),
      augment="none" if args.image_size is not None else args.augment)  # Else the recipe's.


def _optimizer_settings(args: argparse.Namespace) -> dict:
  """The keywords of `optimizers.check` and `optimizers.make` beyond name and lr."""
  return {"schedule": args.schedule, "warmup_steps": args.warmup_steps,
          "total_steps": args.steps, "clip_norm": args.clip_norm,
          "weight_decay": args.weight_decay, "decay_all": args.decay_all}


def _optimizer_identity(args: argparse.Namespace) -> str:
  """The optimizer settings a checkpoint must match to be resumed."""
  identity = (f"{args.optimizer}|{args.lr}|{args.schedule}|{args.warmup_steps}|"
              f"{args.clip_norm}|{args.weight_decay}")
  # Decay of every leaf was the only rule before the mask: its checkpoints
  # resume under decay-all, and the mask's refuse them, naming this field.
  if optimizers.decays(args.optimizer, args.weight_decay) and not args.decay_all:
    identity += "|decay: leaves of 2+ dimensions"
  return identity


def train(args: argparse.Namespace) -> dict:
  """Runs one host's part of the job; returns the summary."""
  _check_args(args)
  from hetjax import models as zoo
  from hetjax import modes, phases, trainer
  from hetjax.cluster import runtime
  from hetjax.input import loader
  from hetjax.observe import goodput_record, progress

  topo = runtime.initialize(timeout_s=args.init_timeout)
  if topo.num_hosts > 1:  # JAX's own aborts in one line, the report beside a lost peer's.
    from hetjax.cluster import abort_report
    abort_report.start(args.out or args.ckpt_dir, topo.host_id)
  if goodput_record.active() is not None:
    goodput_record.active().bind(topo.host_id)
  images = {"image_size": args.image_size} if args.image_size is not None else {}
  with phases.within(phases.BUILDING):  # The data and the model: building, as the Trainer's.
    source, test_source = _load_data(args)
    if test_source is not None:
      from hetjax.input import sources
      sources.check_records(test_source, sources.record_spec(source))  # Before training.
    if args.eval_every and test_source is None:
      raise ValueError(f"--eval-every evaluates on the test split of image datasets; dataset "
                       f"{args.dataset!r} has none here, so drop --eval-every.")
    info = source.info
    task = (user_code.build_task(args.model, info, _model_overrides(args))
            if user_code.is_factory(args.model) else
            zoo.build(args.model, kind=info.kind, num_classes=info.num_classes,
                      vocab_size=info.vocab_size, **_model_overrides(args)))
  config = _train_config(args)
  identity = f"{args.model}|{_optimizer_identity(args)}|{args.model_width}|{args.dropout}"
  identity += f"|{args.image_size}|{args.augment}" if images else ""
  ckpt = None if args.ckpt_dir is None else _checkpoint_config(args)
  # --mode hybrid / elastic: --steps counts rounds, --optimizer is the inner one.
  rounds = flags.rounds_config(args, topo.num_hosts)
  workers = args.data_workers if args.data_workers is not None else (
      loader.default_workers() if images else 0)
  mode = modes.Sync(data_workers=workers) if rounds is None else modes.from_config(rounds)
  optimizer = optimizers.make(args.optimizer, args.lr, **_optimizer_settings(args))
  tr = trainer.Trainer(task, optimizer, source, config, mode=mode, identity=identity,
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
      try:
        tracked.close(exit_code=1)
      except Exception as e:  # noqa: BLE001 (W&B's own failure must not replace the job's)
        print(f"hetjax: closing the W&B run failed ({e!r})", file=sys.stderr)
    raise
  finally:
    bar.close()
  with phases.within(phases.SUMMARY, tr.step):  # Closing, the digest, the files: the run's end.
    _finish(args, tr, summary, topo.host_id, tracked)
  return summary


def _finish(args: argparse.Namespace, tr, summary: dict, host_id: int, tracked) -> None:
  """After the last step: close the trainer, complete and write the summary, save the params."""
  import numpy as np
  from hetjax import trainer

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
  if host_id == 0 and args.save_params:
    import jax
    flat = {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tr.params())}
    np.savez(args.save_params, **flat)
  if tracked is not None:
    tracked.finish(summary, _report_picture(args.out))


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
  """The command line, with `train --config FILE` read in first so that flags override it
  (a bad file: a usage error, exit 2)."""
  parser = flags.parser()
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  if args.command == "train" and args.config:
    from hetjax.cli import config_file
    train_parser = flags.train_parser(parser)
    try:
      train_parser.set_defaults(**config_file.read(args.config))
    except ValueError as e:
      train_parser.error(str(e))
    args = parser.parse_args(argv)  # The file's values as defaults: the flags override them.
  return args


def resolved_config(args: argparse.Namespace) -> dict:
  """Every `hetjax train` setting's value, as OUT/config.yaml holds it."""
  from hetjax.cli import config_file
  return config_file.resolved(args)


def _write_config(args: argparse.Namespace) -> None:
  """OUT/config.yaml: `hetjax train --config OUT/config.yaml` runs this job again."""
  from hetjax.cli import config_file
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, config_file.CONFIG_FILE), "w") as f:
    f.write(config_file.dump(resolved_config(args), head=True))


def _print_summary(summary: dict, out: str | None = None) -> None:
  """The end of a run as a person reads it: a few rounded figures, where the time went, and
  where the whole summary is."""
  from hetjax.observe import goodput_summary
  rounds = summary.get("mode") in ("hybrid", "elastic")
  per = "/round" if rounds else "/step"
  head = [f"{summary['mode']} mode, {summary['steps']} rounds" if rounds
          else f"{summary['steps']} steps"]
  goodput = summary.get("goodput")
  if goodput:
    head.append(f"{goodput_summary.duration(goodput['wall_s'])} job time")
  head.append(f"{summary.get('samples_per_sec') or 0.0:,.1f} samples/s")
  head.append(f"{summary['global_batch']} samples{'/local step' if rounds else '/step'} over "
              f"{summary['hosts']} host{'s' if summary['hosts'] != 1 else ''}")
  if summary.get("final_loss") is not None:
    head.append(f"final loss {summary['final_loss']:.4f}")
  if summary.get("test_accuracy") is not None:
    head.append(f"test accuracy {summary['test_accuracy']:.2%}")
  print("hetjax: " + ", ".join(head) + ("  (emulated speeds)" if summary["emulated_speeds"] else ""))
  for i, host in enumerate(summary["per_host"]):
    if not host["compute_s"] or not host["wait_s"]:
      continue  # A resumed run that had nothing left to do.
    c, w = host["compute_s"][2:] or host["compute_s"], host["wait_s"][2:] or host["wait_s"]
    work = (f"{host['batch'][-1]:4d} samples{per}" +
            (f" ({host['tau'][-1]} local steps)" if rounds and host.get("tau") else ""))
    print(f"  host {i}: {work}  compute {sum(c) / len(c) * 1e3:7.1f} ms{per}  "
          f"wait {sum(w) / len(w) * 1e3:7.1f} ms{per}"
          + ("  (emulated speeds)" if summary["emulated_speeds"] else ""))
  for line in goodput_summary.lines(goodput, summary.get("balancer_saving"), causes=4):
    print("  " + line)
  where = os.path.join(out, "summary.json") if out else "summary.json"
  print(f"  every figure: {where}" + (f" (params digest {summary['params_digest'][:16]})"
                                      if summary.get("params_digest") else ""))


def _exit_now(code: int) -> None:
  """Leaves at once: JAX's exit-time shutdown would wait for the other hosts."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _say_failure(error: BaseException, args: argparse.Namespace) -> None:
  """A peer's loss in one line (the traceback in a file under --out); anything else in full."""
  from hetjax.cluster import lost_peer, watchdog
  if not lost_peer.is_peer_failure(error):
    traceback.print_exc()
    return
  dog = watchdog.WATCHDOG
  line, marker = lost_peer.explain(error, config_lib.host_id_from_env(),
                                   config_lib.num_hosts_from_env(), dog.position,
                                   getattr(args, "out", None) or getattr(args, "ckpt_dir", None),
                                   watchdog.service_alive, dog.unit)
  print(f"hetjax {args.command}: error: {line}", file=sys.stderr)
  print(marker, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.command == "train" and args.print_config:  # Only a configuration that would run.
    from hetjax.cli import config_file
    try:
      _check_args(args)
    except ValueError as e:
      flags.train_parser(flags.parser()).error(str(e))
    print(config_file.dump(resolved_config(args)), end="")
    return 0
  if args.command in ("report", "doctor"):
    from hetjax.cluster import doctor
    from hetjax.observe import report
    return {"report": report, "doctor": doctor}[args.command].run(args)
  # Read when needed: joining a SLURM / Open MPI cluster writes HETJAX_NUM_HOSTS.
  multi_host = lambda: config_lib.num_hosts_from_env() > 1
  from hetjax.cluster import signals  # Stdlib only: bad arguments still fail before JAX loads.
  try:
    # From the start: a signal while joining or compiling stops this host at once (exit
    # 75 / 130), not swallowed by JAX; in the step loop it waits for the agreed boundary.
    from hetjax.observe import goodput_record  # Stdlib only, as signals.
    with signals.REQUESTS.installed(defer=False), goodput_record.recording(
        args.out, config_lib.host_id_from_env):
      summary = train(args)
  except (ValueError, ConnectionError) as e:
    from hetjax.cluster import lost_peer
    if (multi_host() and isinstance(e, ValueError)
        and lost_peer.is_peer_failure_raised_as_value_error(e)):
      _say_failure(e, args)  # JAX raised a failed collective as a ValueError.
      _exit_now(exits.FAILED_EXIT)
    # The library names its settings as fields (`global_batch`); here they are flags.
    print(f"hetjax {args.command}: error: {flags.as_flags(str(e))}", file=sys.stderr)
    if multi_host():
      _exit_now(exits.USAGE_EXIT)
    return exits.USAGE_EXIT
  except exits.JobExit as e:  # A stop, a failed checkpoint write, replicas that differ.
    print(f"hetjax {args.command}: {e.label}{e}", file=sys.stderr)
    _exit_now(e.exit_code)
  except KeyboardInterrupt:  # A second Ctrl-C inside the step loop.
    print(f"hetjax {args.command}: interrupted (Ctrl-C) before a step boundary; nothing saved.",
          file=sys.stderr)
    _exit_now(exits.INTERRUPTED_EXIT)
  except BaseException as e:
    if not multi_host():
      raise
    _say_failure(e, args)
    _exit_now(exits.FAILED_EXIT)
  if summary and config_lib.host_id_from_env() == 0:
    _print_summary(summary, args.out)
  return 0

