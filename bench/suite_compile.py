"""The test suite's XLA:CPU flags: time to a trainer's first steps, with and without the emitters flag.

Run from the repository root (13 minutes on 2 cores, most of it ResNet-18):

  .venv/bin/python bench/suite_compile.py [--models cnn,resnet18,transformer] [--repeats 3]

tests/conftest.py compiles the suite's programs with cheap passes (LLVM at
-O0, one codegen thread) and XLA's classic loop emitters
(`--xla_cpu_use_fusion_emitters=false`). This script measures what the
emitters flag buys: each model's `hetjax.Trainer(...).fit(2)` on 1 host x 2
XLA:CPU devices with device batch 4 (so the ladder's programs for 4, 2 and 1
blocks all compile), in a fresh process each time (no compilation cache),
alternating the two flag sets R times. It prints the median of the
per-repeat ratios of the seconds to those first steps (interleaving cancels
machine noise), then the steps/s after them, which the flag must not cost.
The last line printed is one JSON object: `{model: first-steps ratio}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHEAP = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
         "--xla_cpu_parallel_codegen_split_count=1")
FLAG_SETS = {"fusion emitters": CHEAP,
             "classic emitters": CHEAP + " --xla_cpu_use_fusion_emitters=false"}

_CHILD = r"""
import json, sys, time
import jax, optax
import hetjax
from hetjax import models as zoo
from hetjax.input import data
model = sys.argv[1]
source = data.load("tokens" if model == "transformer" else "digits")
task = (zoo.build("transformer", kind="tokens", vocab_size=source.info.vocab_size, num_layers=1,
                  d_model=32) if model == "transformer"
        else zoo.build(model, kind="image", num_classes=10))
config = hetjax.TrainConfig(global_batch=64, microbatch=4, device_batch=4, check_every=0)
tr = hetjax.Trainer(task, optax.adam(1e-3), source, config)
start = time.perf_counter()
tr.fit(2)
jax.block_until_ready(tr.params())
first = time.perf_counter() - start
start = time.perf_counter()
tr.fit(20)
jax.block_until_ready(tr.params())
print(json.dumps({"first_s": first, "steps_per_s": 20 / (time.perf_counter() - start)}))
"""


def _run(model: str, flags: str) -> dict:
  env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2",
         "JAX_ENABLE_COMPILATION_CACHE": "false"}
  out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, capture_output=True,
                       text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="cnn,resnet18,transformer")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  out = {}
  for model in args.models.split(","):
    runs = {name: [] for name in FLAG_SETS}
    for _ in range(args.repeats):
      for name, flags in FLAG_SETS.items():
        runs[name].append(_run(model, flags))
    first = [a["first_s"] / b["first_s"] for a, b in zip(runs["fusion emitters"],
                                                          runs["classic emitters"])]
    speed = [b["steps_per_s"] / a["steps_per_s"] for a, b in zip(runs["fusion emitters"],
                                                                  runs["classic emitters"])]
    out[model] = round(statistics.median(first), 2)
    medians = {name: statistics.median(r["first_s"] for r in rs) for name, rs in runs.items()}
    print(f"{model}: first 2 steps {medians['fusion emitters']:.1f} s with fusion emitters, "
          f"{medians['classic emitters']:.1f} s with classic ones: {out[model]:.2f}x faster; "
          f"steps/s after them {statistics.median(speed):.2f}x ({args.repeats} repeats)",
          flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
