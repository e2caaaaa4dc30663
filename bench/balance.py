"""Balanced vs equal split on an EMULATED 3-host cluster, measured side by side.

Run: `.venv/bin/python bench/balance.py` (about 5 minutes on 2 cores).

Three host processes (speeds 1, 0.5, 0.25, emulated by pacing) train the
CNN on the digits with the modes `equal`, `static` and `dynamic`, one after
another in one invocation. Each host's device is EMULATED
(HETJAX_DEVICE_SAMPLE_MS): its local step takes the real compute plus
`samples x ms / speed` of paced device time, so that, as on a GPU cluster,
the local compute dominates a step, grows with the share, and the
cross-host reduction is a small part of it; the host's own overhead stays
real. The reduction's measured share of the step is printed next to the
figures.

Figures per mode (steady state: the second half of the steps):
- samples/s, and the speedup over `equal`, next to the bound sum(s)/(N min s);
- efficiency = samples/s / ideal, ideal = the sum of the hosts' own measured
  throughputs (share / local compute seconds): what the hosts could do if no
  one ever waited and the reduction cost nothing.
Part two injects a 3x slowdown on host 0 halfway through a `dynamic` run and
counts the steps until the efficiency is back above 0.85.
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SPEEDS = (1.0, 0.5, 0.25)
RECOVERY_LEVEL = 0.85


def host_main(mode: str, global_batch: int, microbatch: int, steps: int,
              balancer_options: dict) -> dict | None:
  """One host's run (called by hetjax.testing.run_hosts in each host process)."""
  import optax  # pylint: disable=g-import-not-at-top
  import hetjax  # pylint: disable=g-import-not-at-top
  from hetjax import models as zoo
  from hetjax import balancer, trainer  # pylint: disable=g-import-not-at-top
  from hetjax.input import data

  hetjax.initialize()
  source = data.load("digits")
  task = zoo.build("cnn", kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=global_batch, microbatch=microbatch, balancer=mode)
  custom = None
  if mode in ("static", "dynamic") and balancer_options:
    custom = balancer.make_balancer("equal", global_batch, 3, mode=mode,
                                    granularity=[microbatch] * 3, **balancer_options)
  tr = trainer.Trainer(task, optax.adam(1e-3), source, config, balancer=custom)
  summary = tr.fit(steps)
  if tr.host_id != 0:
    return None
  return {"step_s": tr.history.step_s, "shares": tr.history.shares,
          "compute_s": tr.history.compute_s, "wait_s": [h["wait_s"] for h in summary["per_host"]],
          "decisions": summary["balancer_decisions"]}


def per_step(run: dict) -> dict[str, np.ndarray]:
  """Per-step arrays: samples/s, ideal samples/s, efficiency, reduction seconds."""
  step_s = np.asarray(run["step_s"])
  shares = np.asarray(run["shares"], np.float64)
  compute = np.asarray(run["compute_s"])
  waits = np.asarray(run["wait_s"]).T  # [steps, hosts]
  batch = shares.sum(axis=1)
  own = np.where(shares > 0, shares / np.maximum(compute, 1e-9), 0.0)
  ideal = own.sum(axis=1)
  return {"samples_per_s": batch / step_s, "ideal": ideal, "efficiency": batch / step_s / ideal,
          # The host that arrives last waits for the reduction only.
          "reduction_s": waits.min(axis=1), "step_s": step_s}


def steady_figures(run: dict) -> dict[str, float]:
  s = per_step(run)
  half = len(s["step_s"]) // 2
  samples = float(np.sum(np.asarray(run["shares"])[half:]))
  sps = samples / float(np.sum(s["step_s"][half:]))
  ideal = float(np.mean(s["ideal"][half:]))
  reduction = float(np.median(s["reduction_s"][half:]))
  return {"samples_per_s": sps, "ideal_samples_per_s": ideal, "efficiency": sps / ideal,
          "reduction_s": reduction, "step_s": float(np.median(s["step_s"][half:])),
          "reduction_share": reduction / float(np.median(s["step_s"][half:])),
          "final_shares": list(run["shares"][-1])}


def recovery_steps(run: dict, slowdown_step: int) -> int | None:
  """Slowed steps before the efficiency is back above 0.85 for good.

  The first step `r >= slowdown_step` whose efficiency, and the median of
  the five from it, exceed the level; `r - slowdown_step` steps ran below it.
  """
  eff = per_step(run)["efficiency"]
  for r in range(slowdown_step, len(eff) - 4):
    if eff[r] > RECOVERY_LEVEL and np.median(eff[r:r + 5]) > RECOVERY_LEVEL:
      return r - slowdown_step
  return None


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=60, help="steps per mode")
  p.add_argument("--recovery-steps", type=int, default=80, help="steps of the slowdown run")
  p.add_argument("--global-batch", type=int, default=192)
  p.add_argument("--microbatch", type=int, default=4)
  p.add_argument("--sample-ms", type=float, default=5.0,
                 help="emulated device milliseconds per sample on the fastest host")
  p.add_argument("--every", type=int, default=None, help="dynamic: re-solve every K steps")
  p.add_argument("--max-move", type=float, default=None, help="dynamic: rate limit (share of B)")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from hetjax.testing import run_hosts  # pylint: disable=g-import-not-at-top

  options = {k: v for k, v in (("every", args.every), ("max_move", args.max_move)) if v is not None}
  env = {"HETJAX_DEVICE_SAMPLE_MS": f"{args.sample_ms:g}"}
  bound = sum(SPEEDS) / (len(SPEEDS) * min(SPEEDS))
  print(f"EMULATED cluster: 3 hosts x 1 CPU device, speeds {SPEEDS}, emulated device "
        f"{args.sample_ms:g} ms/sample on the fastest host; CNN on digits, global batch {args.global_batch}, "
        f"{args.steps} steps per mode. Shared 2-core CPU: read the ratios, not the times.")
  figures, t0 = {}, time.time()
  for mode in ("equal", "static", "dynamic"):
    run = run_hosts("balance:host_main", hosts=3, speeds=list(SPEEDS), env=env, timeout_s=900,
                    args=(mode, args.global_batch, args.microbatch, args.steps,
                          options if mode == "dynamic" else {}))[0]
    figures[mode] = steady_figures(run)
  for mode, f in figures.items():
    f["speedup_over_equal"] = f["samples_per_s"] / figures["equal"]["samples_per_s"]
    print(f"{mode:8s} {f['samples_per_s']:7.1f} samples/s  speedup over equal "
          f"{f['speedup_over_equal']:.2f}x (bound {bound:.2f}x)  efficiency {f['efficiency']:.3f}  "
          f"reduction {f['reduction_s'] * 1e3:.1f} ms = {f['reduction_share']:.1%} of a "
          f"{f['step_s'] * 1e3:.0f} ms step  shares {f['final_shares']}")
  slow_at = args.recovery_steps // 2
  run = run_hosts("balance:host_main", hosts=3, speeds=list(SPEEDS), timeout_s=900,
                  env={**env, "HETJAX_SLOWDOWN": f"0:3@{slow_at}"},
                  args=("dynamic", args.global_batch, args.microbatch, args.recovery_steps,
                        options))[0]
  recovery = recovery_steps(run, slow_at)
  after = steady_figures(run)
  eff = per_step(run)["efficiency"]
  print(f"dynamic, host 0 3x slower from step {slow_at} (emulated): back above "
        f"{RECOVERY_LEVEL} efficiency after {recovery} steps; efficiency over the last half "
        f"{after['efficiency']:.3f}, shares {run['shares'][slow_at - 1]} -> {run['shares'][-1]}")
  print("per-step efficiency after the slowdown: "
        + " ".join(f"{e:.2f}" for e in eff[slow_at:slow_at + 25]))
  result = {
      "emulated": True, "speeds": SPEEDS, "device_sample_ms": args.sample_ms, "bound": bound,
      "global_batch": args.global_batch, "steps": args.steps,
      **{f"{m}_{k}": v for m, f in figures.items() for k, v in f.items() if k != "final_shares"},
      "recovery_steps": recovery, "recovery_level": RECOVERY_LEVEL,
      "slowdown": f"0:3@{slow_at}", "seconds": round(time.time() - t0, 1)}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
