"""An input-bound host beside fast ones: the balancer against the bound, EMULATED.

Run: `.venv/bin/python bench/input_bound.py [--steps 40] [--input-ms 8] [--device-ms 2]`
(about 4 minutes on 2 shared cores).

Three host processes train the CNN on the digits (global batch 96, blocks
of 4). Every host's device is EMULATED at `--device-ms` per sample
(HETJAX_DEVICE_SAMPLE_MS); host 2's input is EMULATED as a host short of
CPU: its reader needs `--input-ms` per record (HETJAX_INPUT_SAMPLE_MS), read
ahead while the step computes, as decoding is. So host 2 delivers
1000 / max(device, input) samples/s and the others 1000 / device: input,
not compute, bounds it. The modes `equal` and `dynamic` run one after the
other; per mode: samples/s over the second half of the steps, the speedup
over equal against the bound sum(s) / (N min s), the last shares, and each
host's seconds waiting for input and computing (the goodput record).
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

STARVED = 2


def host_main(mode: str, steps: int, out: str) -> dict | None:
  """One host's run (called by hetjax.testing.run_hosts in each host process)."""
  import optax

  import hetjax
  from hetjax import models as zoo
  from hetjax.input import data

  hetjax.initialize()
  config = hetjax.TrainConfig(global_batch=96, microbatch=4, balancer=mode, check_every=0)
  trainer = hetjax.Trainer(zoo.build("cnn", kind="image", num_classes=10), optax.adam(1e-3),
                           data.load("digits"), config)
  trainer.fit(steps, out=out)
  if trainer.host_id != 0:
    return None
  return {"shares": [list(s) for s in trainer.history.shares], "step_s": list(trainer.history.step_s)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=40, help="steps per mode")
  p.add_argument("--input-ms", type=float, default=8.0, help="host 2's input ms per record")
  p.add_argument("--device-ms", type=float, default=2.0, help="every host's device ms per sample")
  args = p.parse_args(argv)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from hetjax.observe import goodput
  from hetjax.testing import run_hosts

  speeds = [1.0, 1.0, args.device_ms / max(args.device_ms, args.input_ms)]
  bound = sum(speeds) / (len(speeds) * min(speeds))
  print(f"EMULATED: 3 hosts x 1 CPU device at {args.device_ms:g} ms/sample; host {STARVED}'s input "
        f"{args.input_ms:g} ms/record (short of CPU), so relative rates {speeds}; CNN on digits, "
        f"global batch 96, {args.steps} steps per mode. Shared CPU: read the ratios, not the times.")
  figures, t0 = {}, time.time()
  for mode in ("equal", "dynamic"):
    with tempfile.TemporaryDirectory(prefix="hetjax-input-bound-") as out:
      run = run_hosts("input_bound:host_main", hosts=3, args=(mode, args.steps, out), timeout_s=900,
                      env={"HETJAX_DEVICE_SAMPLE_MS": f"{args.device_ms:g}"},
                      host_env={STARVED: {"HETJAX_INPUT_SAMPLE_MS": f"{args.input_ms:g}"}})[0]
      job = goodput.read_job(out)
    half = args.steps // 2
    samples = float(np.sum(run["shares"][half:]))
    figures[mode] = {"samples_per_s": samples / float(np.sum(run["step_s"][half:])),
                     "final_shares": run["shares"][-1],
                     "waiting_for_input_s": [round(h.seconds[goodput.INPUT], 2) for h in job.hosts],
                     "compute_s": [round(h.seconds[goodput.COMPUTE], 2) for h in job.hosts]}
  for mode, f in figures.items():
    f["speedup_over_equal"] = f["samples_per_s"] / figures["equal"]["samples_per_s"]
    print(f"{mode:8s} {f['samples_per_s']:7.1f} samples/s  speedup over equal "
          f"{f['speedup_over_equal']:.2f}x (bound {bound:.2f}x)  shares {f['final_shares']}  "
          f"seconds waiting for input / computing, per host: {f['waiting_for_input_s']} / "
          f"{f['compute_s']}")
  result = {"emulated": True, "device_ms": args.device_ms, "input_ms": args.input_ms,
            "speeds": speeds, "bound": bound, "steps": args.steps, **figures,
            "seconds": round(time.time() - t0, 1)}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
