"""Validation of hetjax.sim.sync: replay the EMULATED 3-host cluster of bench/balance.py.

Run: `.venv/bin/python bench/validate_sim.py` (about 5 minutes on 2 cores).

One invocation measures and predicts side by side:
1. MEASURED: bench/balance.py's emulated cluster (3 host processes, speeds
   1 / 0.5 / 0.25 by device pacing, CNN on the digits) runs `equal`,
   `static` and `dynamic`, then a `dynamic` run where host 0 becomes 3x
   slower halfway.
2. Calibration from the `equal` run ONLY: each host's real per-step overhead
   (its measured compute minus the emulated device time it was paced for),
   the reduction time and the timing noise.
3. PREDICTED: `hetjax.sim.sync` with those values and the real balancer predicts
   the other three runs, which it never saw: static / equal and dynamic /
   equal speedups, and the steps to recover from the slowdown.
The emulator paces the device part exactly as the simulator's cost model
does, so agreement there is built in; what this checks is the rest (the
real host overhead, the reduction, the noise, the balancer's own moves).
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import balance  # noqa: E402  (bench/balance.py: the measured side)

from hetjax import balancer  # noqa: E402
from hetjax.sim import sync as sim


def calibrate(run: dict, sample_ms: float, speeds) -> dict:
  """Per-host overhead, reduction seconds and noise from a measured `equal` run."""
  shares = np.asarray(run["shares"], np.float64)
  compute = np.asarray(run["compute_s"])
  half = len(compute) // 2
  device = shares * (sample_ms / 1e3) / np.asarray(speeds)
  overhead = np.median((compute - device)[half:], axis=0)
  figures = balance.per_step(run)
  reduction = float(np.median(figures["reduction_s"][half:]))
  rel = compute[half:] / np.median(compute[half:], axis=0) - 1.0
  noise = float(1.4826 * np.median(np.abs(rel)))
  return {"overhead_s": overhead.tolist(), "reduction_s": reduction, "noise": noise}


def predict(calib: dict, mode: str, args, speeds, steps: int,
            slowdown_at: int | None = None, seeds=(0, 1, 2)) -> dict:
  """Simulated `mode` on the calibrated 3-host cluster; the figures of balance.py."""
  n = len(speeds)
  spec = sim.ClusterSpec(("A100",) * n, devices_per_host=1, microbatch=args.microbatch,
                         per_host_batch=args.global_batch // n, noise=calib["noise"],
                         straggler_rate=0.0, persistent_fraction=0.0)
  costs = balancer.CostParams(np.asarray(calib["overhead_s"]),
                              (args.sample_ms / 1e3) / np.asarray(speeds), spec.granularity)
  out = []
  for seed in seeds:
    factors = sim.noise_factors(spec, steps, seed)
    if slowdown_at is not None:
      factors[slowdown_at:, 0] *= 3.0
    bal = sim.make(mode, spec)
    r = sim.simulate(spec, bal, steps, seed=seed, factors=factors, costs=costs,
                     comm_s=calib["reduction_s"], measure_from=steps // 2)
    # The same per-step record balance.py reads from a measured run.
    waits = (r.compute_s.max(axis=1, keepdims=True) - r.compute_s + calib["reduction_s"]).T
    record = {"step_s": r.step_s.tolist(), "shares": [list(s) for s in r.shares],
              "compute_s": r.compute_s.tolist(), "wait_s": waits.tolist()}
    f = balance.steady_figures(record)
    if slowdown_at is not None:
      f["recovery_steps"] = balance.recovery_steps(record, slowdown_at)
    out.append(f)
  return {k: (float(np.mean([f[k] for f in out])) if k != "recovery_steps" else
              [f[k] for f in out]) for k in out[0] if k != "final_shares"}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=60, help="steps per mode")
  p.add_argument("--recovery-steps", type=int, default=80)
  p.add_argument("--global-batch", type=int, default=192)
  p.add_argument("--microbatch", type=int, default=4)
  p.add_argument("--sample-ms", type=float, default=5.0)
  args = p.parse_args(argv)
  from hetjax.testing import run_hosts  # pylint: disable=g-import-not-at-top

  speeds = balance.SPEEDS
  env = {"HETJAX_DEVICE_SAMPLE_MS": f"{args.sample_ms:g}"}
  t0 = time.time()
  measured_runs = {}
  for mode in ("equal", "static", "dynamic"):
    measured_runs[mode] = run_hosts(
        "balance:host_main", hosts=3, speeds=list(speeds), env=env, timeout_s=900,
        args=(mode, args.global_batch, args.microbatch, args.steps, {}))[0]
  slow_at = args.recovery_steps // 2
  recovery_run = run_hosts(
      "balance:host_main", hosts=3, speeds=list(speeds), timeout_s=900,
      env={**env, "HETJAX_SLOWDOWN": f"0:3@{slow_at}"},
      args=("dynamic", args.global_batch, args.microbatch, args.recovery_steps, {}))[0]
  measured = {m: balance.steady_figures(r) for m, r in measured_runs.items()}
  measured_recovery = balance.recovery_steps(recovery_run, slow_at)

  calib = calibrate(measured_runs["equal"], args.sample_ms, speeds)
  predicted = {m: predict(calib, m, args, speeds, args.steps) for m in ("equal", "static", "dynamic")}
  predicted_recovery = predict(calib, "dynamic", args, speeds, args.recovery_steps, slow_at)

  print(f"EMULATED 3-host cluster (speeds {speeds}, device {args.sample_ms:g} ms/sample) MEASURED, "
        f"next to hetjax.sim.sync's SIMULATED prediction calibrated on the equal run only:")
  print(f"  calibration: host overhead {[round(v * 1e3, 1) for v in calib['overhead_s']]} ms, "
        f"reduction {calib['reduction_s'] * 1e3:.1f} ms, noise {calib['noise']:.1%}")
  rows = {}
  for mode in ("static", "dynamic"):
    m = measured[mode]["samples_per_s"] / measured["equal"]["samples_per_s"]
    s = predicted[mode]["samples_per_s"] / predicted["equal"]["samples_per_s"]
    rows[mode] = {"measured": round(m, 3), "predicted": round(s, 3), "error": round(s / m - 1, 3)}
    print(f"  {mode:8s} speedup over equal: measured (emulated) {m:.2f}x, predicted (simulated) "
          f"{s:.2f}x, error {s / m - 1:+.1%}; efficiency measured {measured[mode]['efficiency']:.3f}, "
          f"predicted {predicted[mode]['efficiency']:.3f}")
  print(f"  recovery after host 0 is 3x slower at step {slow_at}: measured (emulated) "
        f"{measured_recovery} steps, predicted (simulated) {predicted_recovery['recovery_steps']} "
        f"steps (3 seeds)")
  result = {"emulated_vs_simulated": True, "calibration": calib, "speedup_over_equal": rows,
            "recovery_steps": {"measured": measured_recovery,
                               "predicted": predicted_recovery["recovery_steps"]},
            "efficiency": {m: {"measured": round(measured[m]["efficiency"], 3),
                               "predicted": round(predicted[m]["efficiency"], 3)}
                           for m in ("equal", "static", "dynamic")},
            "seconds": round(time.time() - t0, 1)}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
