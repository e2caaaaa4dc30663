"""What a step costs as hosts are added: the cross-host reduction's share, and its collectives.

Run from the repository root (a few minutes):

  .venv/bin/python bench/multihost_step.py [--models mlp,cnn] [--hosts 1,2,3] \
      [--steps 40] [--repeats 3] [--reduction device|host] [--optimizer adam|adafactor|muon]

Each model trains with `Trainer.fit` on sklearn digits (adam, global batch
32, one device per host, every host the same speed: no pacing) on 1, 2 and
3 emulated hosts on this machine. After a warm-up of 5 steps (the
compiles), `--steps` steps are timed on every host; host 0's time per step is
the figure, the median of `--repeats` fits in one cluster. The ratio to
1 host says what joining hosts costs a step here: on a 2-core machine the
hosts share the cores, so it mixes the collectives' cost with the hosts'
contention (emulated hosts, not a network). The reduction program's
collectives are counted in its optimized HLO (`--xla_dump_to` on host 0):
the sharded update's reduce-scatter, its gathers, and any that XLA added.
`--optimizer adafactor` or `muon` measures the sharded update's whole
layout (the update on the real leaves; `hetjax.step.optimizer_layout`).
The last line is one JSON object: per model and host count, ms per step,
the ratio to 1 host and the collectives by kind.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

import optax

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


OPTIMIZERS = {"adam": lambda: hetjax_optimizers().make("adam", 1e-3),
              "adafactor": lambda: optax.adafactor(1e-3),
              "muon": lambda: optax.contrib.muon(1e-3)}


def hetjax_optimizers():
  from hetjax import optimizers
  return optimizers


def time_steps(model: str, steps: int, repeats: int, reduction: str,
               optimizer: str = "adam") -> float:
  """On every host: ms per step of `Trainer.fit(steps)`, median of `repeats` fits (host 0's)."""
  import hetjax
  from hetjax import models as zoo
  from hetjax import trainer
  from hetjax.input import data

  hetjax.initialize()
  task = zoo.build(model, kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=32, microbatch=32, seed=0, reduction=reduction,
                               balancer="equal")
  tr = trainer.Trainer(task, OPTIMIZERS[optimizer](), data.load("digits"), config)
  tr.fit(5)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    tr.fit(steps)
    times.append((time.perf_counter() - start) / steps * 1e3)
  tr.close()
  return statistics.median(times)


def count_collectives(folder: str) -> dict[str, int]:
  """Collectives in the optimized HLO of the reduction's program dumped in `folder`."""
  names = [f for f in glob.glob(os.path.join(folder, "*after_optimizations.txt"))
           if re.search(r"sharded_program|reduce_update", os.path.basename(f))]
  counts: collections.Counter = collections.Counter()
  for name in names[:1]:
    text = open(name).read()
    for kind in KINDS:
      counts[kind] = len(re.findall(rf"= [^=]*\b{kind}(-start)?\(", text))
  return {k: v for k, v in counts.items() if v}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="mlp,cnn")
  parser.add_argument("--hosts", default="1,2,3")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--reduction", default="device", choices=("device", "host"))
  parser.add_argument("--optimizer", default="adam", choices=tuple(OPTIMIZERS))
  args = parser.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from hetjax import testing

  out: dict = {}
  for model in args.models.split(","):
    out[model] = {}
    base = None
    for hosts in (int(h) for h in args.hosts.split(",")):
      with tempfile.TemporaryDirectory() as dump:
        flags = os.environ.get("XLA_FLAGS", "")
        host_env = {0: {"XLA_FLAGS": f"{flags} --xla_dump_to={dump} --xla_dump_hlo_as_text"}}
        ms = testing.run_hosts("multihost_step:time_steps", hosts=hosts,
                               args=(model, args.steps, args.repeats, args.reduction,
                                     args.optimizer),
                               host_env=host_env, timeout_s=900)[0]
        collectives = count_collectives(dump)
      base = base or ms
      out[model][hosts] = {"ms_per_step": round(ms, 2), "vs_1_host": round(ms / base, 2),
                           "collectives": collectives}
      print(f"{model:6s} {hosts} host(s): {ms:7.2f} ms/step ({ms / base:4.2f}x 1 host), "
            f"reduction collectives {collectives or '-'}", flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
