"""The `hetjax` command line: `hetjax train ...` runs one host's part of a job.

Run it once per host (the launchers in `launch/` do that); every host must
get the same arguments. Process 0 writes OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import traceback
from typing import Sequence

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="hetjax", description=__doc__.splitlines()[0])
  sub = p.add_subparsers(dest="command", required=True)
  t = sub.add_parser("train", help="train a built-in model on a built-in dataset")
  t.add_argument("--model", default="cnn", help="mlp, cnn, resnet18, resnet50 or transformer")
  t.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                 help="compute type; parameters and gradient sums stay float32 (fp16: loss scaling)")
  t.add_argument("--dataset", default="digits",
                 help="digits, synthetic, synthetic_big, tokens, or tfds:NAME (prepared in --data-dir)")
  t.add_argument("--data-dir", default=None, help="TFDS data folder for --dataset tfds:NAME")
  t.add_argument("--augment", default="none", help="none, crop, flip or crop,flip (images)")
  t.add_argument("--global-batch", type=int, default=64, help="samples per step over all hosts")
  t.add_argument("--steps", type=int, default=100)
  t.add_argument("--optimizer", default="adam", help=", ".join(OPTIMIZERS))
  t.add_argument("--lr", type=float, default=1e-3)
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--assignment", default="equal",
                 help="'equal' or one share per host summing to the global batch, each a whole "
                      "number of --microbatch blocks, e.g. 4,24,36")
  t.add_argument("--balancer", default=None, choices=("equal", "static", "dynamic"),
                 help="size shares from measured step times (default: follow --assignment)")
  t.add_argument("--microbatch", type=int, default=16, help="samples per device per micro-batch")
  t.add_argument("--reduction", default="device", choices=("device", "host"),
                 help="cross-host reduction backend")
  t.add_argument("--out", default="runs/latest",
                 help="folder for summary.json, metrics.jsonl and tensorboard/ (host 0)")
  t.add_argument("--save-params", default=None, metavar="FILE.npz",
                 help="write the final parameters (host 0)")
  t.add_argument("--log-every", type=int, default=10,
                 help="progress line every N steps when not on a terminal (0: none)")
  t.add_argument("--init-timeout", type=float, default=None,
                 help="seconds to reach the coordinator (default HETJAX_INIT_TIMEOUT or 120)")
  t.add_argument("--model-width", type=int, default=None, help="override the model's width")
  t.add_argument("--dropout", type=float, default=None,
                 help="dropout rate of mlp, cnn and transformer (default 0); keyed per block, "
                      "so the same example gets the same mask on any split")
  c = t.add_argument_group("checkpoints (orbax; the folder must be shared by all hosts)")
  c.add_argument("--ckpt-dir", default=None,
                 help="save checkpoints here and resume from the newest one found there")
  c.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
  c.add_argument("--ckpt-keep", type=int, default=3, help="how many checkpoints to keep")
  c.add_argument("--no-resume", dest="resume", action="store_false",
                 help="start afresh even if --ckpt-dir holds a checkpoint")
  c.add_argument("--sync-save", dest="async_save", action="store_false",
                 help="block training while a checkpoint is written (default: background)")
  from hetjax import doctor, report  # Neither imports JAX at module level.
  report.add_arguments(sub.add_parser("report", help="draw and summarise a run folder"))
  doctor.add_arguments(sub.add_parser(
      "doctor", help="check the cluster and measure every host (run it on every host)"))
  return p


def _check_args(args: argparse.Namespace) -> None:
  """Everything that can be checked before JAX starts; raises ValueError."""
  import hetjax_models
  from hetjax import balancer, data

  if args.model not in hetjax_models.MODEL_NAMES:
    raise ValueError(f"unknown model {args.model!r}; choose one of {', '.join(hetjax_models.MODEL_NAMES)}.")
  data.check_dataset_name(args.dataset, args.data_dir)
  from hetjax import augment
  augment.parse(args.augment)
  if args.optimizer not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {args.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}.")
  if args.global_batch < 1:
    raise ValueError(f"--global-batch must be >= 1, got {args.global_batch}.")
  if args.microbatch < 1:
    raise ValueError(f"--microbatch must be >= 1, got {args.microbatch}.")
  if args.steps < 1:
    raise ValueError(f"--steps must be >= 1 (the total, a resumed run does what is left), "
                     f"got {args.steps}.")
  if args.ckpt_dir is not None:
    _checkpoint_config(args).validate()
  if not args.lr > 0:
    raise ValueError(f"--lr must be > 0, got {args.lr}.")
  assignment = balancer.parse_assignment(args.assignment)
  if args.balancer in ("static", "dynamic") and assignment != "equal":
    raise ValueError(f"--balancer {args.balancer} sizes the shares itself; drop --assignment "
                     f"{args.assignment} (or use --balancer equal).")
  if assignment != "equal":
    hosts = int(os.environ.get("HETJAX_NUM_HOSTS", "1"))
    from hetjax import blocks
    blocks.check_aligned(balancer.validate_shares(assignment, args.global_batch, hosts),
                         args.global_batch, args.microbatch)
  if args.dropout is not None:
    if not 0 <= args.dropout < 1:
      raise ValueError(f"--dropout must be in [0, 1), got {args.dropout}.")
    if "dropout" not in hetjax_models.default_config(args.model):
      has = [m for m in hetjax_models.MODEL_NAMES if "dropout" in hetjax_models.default_config(m)]
      raise ValueError(f"model {args.model!r} has no dropout; --dropout applies to "
                       f"{', '.join(has)}.")


def _checkpoint_config(args: argparse.Namespace):
  from hetjax import checkpoint
  return checkpoint.CheckpointConfig(args.ckpt_dir, every=args.ckpt_every, keep=args.ckpt_keep,
                                     resume=args.resume, async_save=args.async_save)


def _optimizer(name: str, lr: float):
  import optax
  return {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, momentum=0.9),
          "adam": lambda: optax.adam(lr), "adamw": lambda: optax.adamw(lr)}[name]()


def train(args: argparse.Namespace) -> dict:
  """Runs one host's part of the job; returns the summary."""
  _check_args(args)
  import numpy as np
  import hetjax_models
  from hetjax import data, metrics, progress, runtime, trainer

  topo = runtime.initialize(timeout_s=args.init_timeout)
  source = data.load(args.dataset, "train", data_dir=args.data_dir)
  test_source = None
  if source.info.kind == "image":
    from hetjax import sources
    test_source = data.load(args.dataset, "test", data_dir=args.data_dir)
    sources.check_records(test_source, sources.record_spec(source))  # Before, not after, training.
  overrides = {} if args.model_width is None else {"width": args.model_width}
  if args.dropout is not None:
    overrides["dropout"] = args.dropout
  task = hetjax_models.build(args.model, kind=source.info.kind, num_classes=source.info.num_classes,
                             vocab_size=source.info.vocab_size, **overrides)
  config = trainer.TrainConfig(global_batch=args.global_batch, microbatch=args.microbatch,
                               seed=args.seed, assignment=args.assignment, reduction=args.reduction,
                               balancer=args.balancer, augment=args.augment,
                               precision=args.precision)
  identity = f"{args.model}|{args.optimizer}|{args.lr}|{args.model_width}|{args.dropout}"
  ckpt = None if args.ckpt_dir is None else _checkpoint_config(args)
  tr = trainer.Trainer(task, _optimizer(args.optimizer, args.lr), source, config,
                       identity=identity, checkpoint=ckpt)
  sinks, writer = [], None
  if topo.host_id == 0:
    writer = metrics.MetricsWriter(args.out, resume_step=tr.resumed_from)
    sinks.append(writer.write)
  bar = progress.Progress(args.steps, host_id=topo.host_id, every=max(args.log_every, 1))
  if args.log_every > 0:
    sinks.append(bar.update)
  try:
    summary = tr.fit(until=args.steps, sinks=sinks)
  finally:
    bar.close()
    if writer is not None:
      writer.close()
  tr.close()
  summary.update(model=args.model, dataset=args.dataset, optimizer=args.optimizer, lr=args.lr,
                 seed=args.seed, command=shlex.join(sys.argv))
  if test_source is not None:
    test = tr.evaluate(test_source)
    summary["test_accuracy"] = test.get("accuracy")
    summary["test_loss"] = test["loss"]
  if topo.host_id == 0:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    if args.save_params:
      import jax
      flat = {jax.tree_util.keystr(k): np.asarray(v)
              for k, v in jax.tree_util.tree_leaves_with_path(tr.params())}
      np.savez(args.save_params, **flat)
  return summary


def _print_summary(summary: dict) -> None:
  keys = ("steps", "global_batch", "hosts", "samples_per_sec", "final_loss", "test_accuracy",
          "params_digest")
  print("summary: " + json.dumps({k: summary[k] for k in keys if k in summary}))
  for i, host in enumerate(summary["per_host"]):
    if not host["compute_s"] or not host["wait_s"]:
      continue  # A resumed run that had nothing left to do.
    c, w = host["compute_s"][2:] or host["compute_s"], host["wait_s"][2:] or host["wait_s"]
    print(f"  host {i}: share {host['batch'][-1]:4d}  compute {sum(c) / len(c) * 1e3:7.1f} ms  "
          f"wait {sum(w) / len(w) * 1e3:7.1f} ms" + ("  (emulated speeds)" if summary["emulated_speeds"] else ""))


def _exit_now(code: int) -> None:
  """Leaves at once: JAX's exit-time shutdown would wait for the other hosts."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.command in ("report", "doctor"):
    from hetjax import doctor, report
    return {"report": report, "doctor": doctor}[args.command].run(args)
  multi_host = int(os.environ.get("HETJAX_NUM_HOSTS", "1")) > 1
  from hetjax import procs
  try:
    summary = train(args)
  except (ValueError, ConnectionError) as e:
    print(f"hetjax {args.command}: error: {e}", file=sys.stderr)
    if multi_host:
      _exit_now(2)
    return 2
  except BaseException as e:
    if type(e).__name__ == "Preempted":  # Not imported up front: the trainer pulls in JAX.
      print(f"hetjax {args.command}: {e}", file=sys.stderr)
      _exit_now(procs.PREEMPTED_EXIT)
    if not multi_host:
      raise
    traceback.print_exc()
    _exit_now(1)
  if summary and int(os.environ.get("HETJAX_HOST_ID", "0")) == 0:
    _print_summary(summary)
  return 0


if __name__ == "__main__":
  sys.exit(main())
