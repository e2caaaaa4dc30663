"""Device batches against one device: how far the parameters move, through the command line.

Run from the repository root (a few minutes on 2 cores):

  .venv/bin/python bench/device_batch_exactness.py [--model resnet18] [--steps 1] \
      [--device-batch 4,2,1] [--assignment 24,16,8]

Two `hetjax train` runs of one job (digits, sgd 0.05, global batch 48,
blocks of 4, seed 5): 1 host x 1 device with one block per program, and 3
emulated hosts x 2 devices (`launch/local.py`) on a fixed uneven
`--assignment` with a device batch per host. Both write their parameters
with `save-params` (a config key); the script prints the largest `max |a - b|` over the
leaves and the largest `max |a - b| / max |b|` (each leaf against its own
largest value) with its leaf, and as its last line
one JSON object `{"max_abs", "max_rel", "worst": leaf, "tolerance_used"}`,
the last `max |a - b| / (1e-5 + 1e-4 |b|)`: at most 1 where
`np.testing.assert_allclose(rtol=1e-4, atol=1e-5)` passes, what the
exactness tests ask of every layout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-4, 1e-5  # What the exactness tests ask of every layout.


def _train(args: argparse.Namespace, out: pathlib.Path, *extra: str) -> list[str]:
  out.mkdir(parents=True, exist_ok=True)
  (out / "keys.yaml").write_text(f"seed: 5\nsave-params: {out / 'params.npz'}\n")  # No flags.
  return [sys.executable, "-m", "hetjax.cli", "train", "--model", args.model, "--dataset",
          "digits", "--optimizer", "sgd", "--lr", "0.05", "--global-batch", "48",
          "--microbatch", "4", "--steps", str(args.steps), "--log-every", "0",
          "--config", str(out / "keys.yaml"), "--out", str(out), *extra]


def _run(command: list[str], env: dict[str, str]) -> None:
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  if done.returncode != 0:
    raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-3000:]}"
                     f"\n{done.stderr[-3000:]}")


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, object]:
  """Largest absolute and relative (to the leaf's largest value) difference over the leaves."""
  if sorted(a) != sorted(b):
    raise ValueError(f"the runs saved different leaves: {sorted(set(a) ^ set(b))}")
  worst = {"max_abs": 0.0, "max_rel": 0.0, "worst": None, "tolerance_used": 0.0}
  for name in sorted(a):
    diff = float(np.max(np.abs(a[name] - b[name])))
    rel = diff / max(float(np.max(np.abs(b[name]))), 1e-30)
    used = float(np.max(np.abs(a[name] - b[name]) / (ATOL + RTOL * np.abs(b[name]))))
    worst["max_abs"] = max(worst["max_abs"], diff)
    worst["tolerance_used"] = max(worst["tolerance_used"], used)
    if rel > worst["max_rel"]:
      worst["max_rel"], worst["worst"] = rel, name
  return worst


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="resnet18")
  p.add_argument("--steps", type=int, default=1)
  p.add_argument("--device-batch", default="4,2,1")
  p.add_argument("--assignment", default="24,16,8")
  args = p.parse_args()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  with tempfile.TemporaryDirectory(prefix="hetjax-exact-") as folder:
    one, three = pathlib.Path(folder, "one"), pathlib.Path(folder, "three")
    _run(_train(args, one), env)
    _run([sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3",
          "--devices-per-host", "2", "--"] + _train(args, three, "--assignment", args.assignment,
                                                    "--device-batch", args.device_batch), env)
    a = dict(np.load(three / "params.npz"))
    b = dict(np.load(one / "params.npz"))
  result = compare(a, b)
  print(f"{args.model}, {args.steps} step(s): 3x2 on {args.assignment} with device batches "
        f"{args.device_batch} against 1x1: max |diff| {result['max_abs']:.3g}, max relative "
        f"{result['max_rel']:.3g} ({result['worst']}), {result['tolerance_used']:.3g} of rtol 1e-4 / "
        f"atol 1e-5")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
