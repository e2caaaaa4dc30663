"""Which mode reaches a target accuracy first on an EMULATED uneven 3-host cluster?

Run: `.venv/bin/python bench/modes.py` (a few minutes on 2 cores).

Three host processes (speeds 1, 0.5, 0.25, emulated by pacing; each host's
device EMULATED with HETJAX_DEVICE_SAMPLE_MS as in bench/balance.py) train
the CNN on the real digits from the same seed with:
- sync-equal: `--mode sync`, equal shares;
- sync-dynamic: `--mode sync --balancer dynamic`;
- hybrid-H4, hybrid-H8: `--mode hybrid --round-steps H`, taus from speeds;
- elastic-H4: `--mode elastic --round-steps 4`.
Every step (sync) or round (hybrid, elastic) every host evaluates the same
centre on the test split; evaluation is kept off the clock (the clock sums
the measured step / round seconds). A run stops once the centre reaches
the target (0.97) or after `--max-epochs` of samples.

Figures per mode, median over the seeds: wall-clock seconds to the target,
the accuracy reached within a common budget (the median time-to-target of
sync-equal, unless `--budget-s`), samples/s, and each mode's time-to-target
over sync-equal's; then, for each rounds mode, the reduction's share of a
sync step above which it would reach the target before sync-dynamic (from
the reductions each needed: `reduction_threshold`). All run inside one
cluster start; all times are EMULATED
and the machine is shared: read the ratios. The last line is one JSON object.

Learning rates: `--sweep` runs seed 0 of every mode at each of `--lrs` and
prints the best (the fastest to the target); the defaults below are what
that sweep chose (see BUILD_NOTES).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SPEEDS = (1.0, 0.5, 0.25)
# mode name -> (trainer kind, settings, inner optimizer momentum, default lr)
MODES = {
    "sync-equal": ("sync", {}, 0.9, 0.1),
    "sync-dynamic": ("sync", {"balancer": "dynamic"}, 0.9, 0.1),
    "hybrid-H4": ("hybrid", {"round_steps": 4}, None, 0.2),
    "hybrid-H8": ("hybrid", {"round_steps": 8}, None, 0.2),
    "elastic-H4": ("elastic", {"round_steps": 4, "beta": 0.5}, 0.9, 0.05),
}


class _Reached(Exception):
  """Raised by every host at the same step: the centre reached the target."""


def host_main(runs: list, global_batch: int, microbatch: int, target: float,
              max_samples: int) -> list | None:
  """Every run of `runs` ((name, seed, lr)) on this cluster; host 0 returns the curves."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import hetjax  # pylint: disable=g-import-not-at-top
  from hetjax import models as zoo
  from hetjax.input import data

  hetjax.initialize()
  source, test = data.load("digits"), data.load("digits", "test")
  test_batch = test[np.arange(len(test))]
  test_batch[hetjax.MASK] = np.ones(len(test), np.float32)
  results = []
  for name, seed, lr in runs:
    kind, settings, momentum, _ = MODES[name]
    task = zoo.build("cnn", kind="image", num_classes=10)
    loss_fn = task.evaluation_loss()

    @jax.jit
    def accuracy(params, model_state):
      _, metrics, _ = loss_fn(params, model_state, test_batch, jax.random.key(0))
      return jnp.mean(metrics["accuracy"])

    _, no_state = jax.jit(task.init)(jax.random.key(0), test_batch)
    assert not jax.tree.leaves(no_state), "the CNN keeps no model state"
    inner = optax.sgd(lr, momentum=momentum)
    if kind == "sync":
      config = hetjax.TrainConfig(global_batch=global_batch, microbatch=microbatch, seed=seed,
                                  balancer=settings.get("balancer"))
      tr = hetjax.Trainer(task, inner, source, config)
      # A step's (round's) seconds and its reduction: the least wait of any host
      # (the last to arrive waits for the reduction alone), as `hetjax report` counts it.
      timed = lambda h, i: (h.step_s[i], min(h.wait_s[i]), global_batch)
    else:
      config = hetjax.TrainConfig(global_batch=global_batch, microbatch=microbatch, seed=seed)
      mode = hetjax.Hybrid(**settings) if kind == "hybrid" else hetjax.Elastic(**settings)
      tr = hetjax.Trainer(task, inner, source, config, mode=mode)
      timed = lambda h, i: (h.step_s[i], min(h.wait_s[i]), int(sum(h.shares[i])))
    # (clock seconds, samples, accuracy, reductions, reduction seconds), evaluation
    # off the clock; step (round) 0 compiles and stays off it too.
    curve, totals = [], {"rows": 0, "s": 0.0, "samples": 0, "reductions": 0, "reduction_s": 0.0}

    def evaluate(tr_, metrics):
      del metrics
      # `params()` is a host copy that lends the trainer nothing (reading
      # `state` would make the next step copy the state before donating it,
      # time the clock would count); the CNN has no model state to read.
      acc = float(accuracy(tr_.params(), no_state))
      # A sync step's timings arrive a step late (the pipeline), so count the
      # history's new rows, whenever they came.
      h = tr_.history  # Keeps a window: row `i` of the run is list index `i - h.dropped`.
      while totals["rows"] < h.dropped + min(len(h.step_s), len(h.wait_s)):
        step_s, reduction_s, samples = timed(h, totals["rows"] - h.dropped)
        totals["samples"] += samples
        if totals["rows"]:
          totals["s"] += step_s
          totals["reductions"] += 1
          totals["reduction_s"] += reduction_s
        totals["rows"] += 1
      curve.append((totals["s"], totals["samples"], acc, totals["reductions"],
                    totals["reduction_s"]))
      if acc >= target or totals["samples"] >= max_samples:
        raise _Reached()

    try:
      tr.fit(10**9, on_step=evaluate)  # Steps or rounds: the one Trainer's loop.
    except _Reached:
      pass
    tr.close()
    results.append({"name": name, "seed": seed, "lr": lr, "curve": curve})
  return results if jax.process_index() == 0 else None


def at_target(curve: list, target: float) -> tuple | None:
  """The curve's first point at or over `target`: (s, samples, accuracy, reductions, reduction s)."""
  return next((point for point in curve if point[2] >= target), None)


def time_to_target(curve: list, target: float) -> float | None:
  point = at_target(curve, target)
  return None if point is None else point[0]


def accuracy_within(curve: list, budget_s: float) -> float:
  inside = [point[2] for point in curve if point[0] <= budget_s]
  return inside[-1] if inside else 0.0


def reduction_threshold(sync: list, rounds: list) -> dict | None:
  """Where a rounds mode would reach the target as soon as sync: the reduction's share of
  a sync step at the crossover, from each run's points at the target (medians over seeds).

  Time to target grows by `n * L` when every reduction costs `L` seconds more
  (`n` the reductions to the target), and a rounds mode makes fewer. So the
  two times meet at `L* = (T_rounds - T_sync) / (n_sync - n_rounds)`, where
  sync's step is `t + L*` and its reduction `r + L*` (`t`, `r` measured per
  step). A rounds mode already faster gives `L* < 0`: its threshold lies
  below the share measured here. The added `L` is EMULATED arithmetic.
  """
  if not sync or not rounds or None in sync or None in rounds:
    return None
  med = lambda points, i: float(np.median([p[i] for p in points]))
  t_s, n_s, r_s = med(sync, 0), med(sync, 3), med(sync, 4)
  t_r, n_r = med(rounds, 0), med(rounds, 3)
  step, reduction = t_s / n_s, r_s / n_s
  out = {"sync_reduction_share": reduction / step, "samples_ratio": med(rounds, 1) / med(sync, 1)}
  if n_r >= n_s:
    return {**out, "added_reduction_s": None, "threshold_share": None}
  added = (t_r - t_s) / (n_s - n_r)
  share = (reduction + added) / (step + added) if step + added > 0 else 0.0
  return {**out, "added_reduction_s": added, "threshold_share": min(max(share, 0.0), 1.0)}


def _median(values: list) -> float | None:
  values = [v for v in values if v is not None]
  return float(np.median(values)) if values else None


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
  p.add_argument("--target", type=float, default=0.97)
  p.add_argument("--global-batch", type=int, default=48)
  p.add_argument("--microbatch", type=int, default=8)
  p.add_argument("--sample-ms", type=float, default=1.0,
                 help="emulated device milliseconds per sample on the fastest host")
  p.add_argument("--max-epochs", type=float, default=12.0, help="give up after this many epochs")
  p.add_argument("--budget-s", type=float, default=None,
                 help="common time budget (default: sync-equal's median time to the target)")
  p.add_argument("--sweep", action="store_true", help="seed 0 of each mode at each of --lrs")
  p.add_argument("--lrs", default="0.02,0.05,0.1,0.2")
  args = p.parse_args(argv)
  names = args.modes.split(",")
  unknown = [n for n in names if n not in MODES]
  if unknown:
    raise SystemExit(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}.")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from hetjax.input import data  # pylint: disable=g-import-not-at-top
  from hetjax.testing import run_hosts  # pylint: disable=g-import-not-at-top

  max_samples = int(args.max_epochs * len(data.load("digits")))
  if args.sweep:
    runs = [(n, 0, float(lr)) for n in names for lr in args.lrs.split(",")]
  else:
    runs = [(n, seed, MODES[n][3]) for n in names for seed in range(args.seeds)]
  print(f"EMULATED cluster: 3 hosts x 1 CPU device, speeds {SPEEDS}, emulated device "
        f"{args.sample_ms:g} ms/sample on the fastest host; CNN on digits, global batch "
        f"{args.global_batch}, target test accuracy {args.target}. Shared CPU: read the ratios.",
        flush=True)
  t0 = time.time()
  env = {"HETJAX_DEVICE_SAMPLE_MS": f"{args.sample_ms:g}"}
  results = run_hosts("modes:host_main", hosts=3, speeds=list(SPEEDS), env=env, timeout_s=3600,
                      args=(runs, args.global_batch, args.microbatch, args.target,
                            max_samples))[0]
  if args.sweep:
    for r in results:
      print(f"{r['name']:13s} lr {r['lr']:<5g} time to {args.target}: "
            f"{time_to_target(r['curve'], args.target)}  final accuracy {r['curve'][-1][2]:.3f}")
    print(json.dumps({"sweep": [{"name": r["name"], "lr": r["lr"],
                                 "time_to_target_s": time_to_target(r["curve"], args.target)}
                                for r in results]}))
    return {}
  by_mode = {n: [r for r in results if r["name"] == n] for n in names}
  ttt = {n: [time_to_target(r["curve"], args.target) for r in rs] for n, rs in by_mode.items()}
  budget = args.budget_s or _median(ttt.get("sync-equal", [])) or max(
      r["curve"][-1][0] for r in results)
  figures = {}
  for n, rs in by_mode.items():
    reached = [t for t in ttt[n] if t is not None]
    figures[n] = {
        "median_time_to_target_s": _median(ttt[n]) if len(reached) == len(rs) else None,
        "reached": f"{len(reached)}/{len(rs)}",
        "accuracy_within_budget": _median([accuracy_within(r["curve"], budget) for r in rs]),
        "samples_per_s": _median([r["curve"][-1][1] / r["curve"][-1][0] for r in rs]),
        "lr": rs[0]["lr"],
    }
  base = figures.get("sync-equal", {}).get("median_time_to_target_s")
  print(f"{'mode':13s} {'to ' + str(args.target):>10s} {'reached':>8s} {'acc@' + format(budget, '.1f') + 's':>10s} "
        f"{'samples/s':>10s} {'vs sync-equal':>14s}")
  for n, f in figures.items():
    t = f["median_time_to_target_s"]
    f["time_ratio_to_sync_equal"] = t / base if (t and base) else None
    ratio = f"{f['time_ratio_to_sync_equal']:.2f}x" if f["time_ratio_to_sync_equal"] else "-"
    print(f"{n:13s} {(f'{t:.1f} s' if t else '-'):>10s} {f['reached']:>8s} "
          f"{f['accuracy_within_budget']:10.3f} {f['samples_per_s']:10.0f} {ratio:>14s}")
  thresholds = {}
  sync_points = [at_target(r["curve"], args.target) for r in by_mode.get("sync-dynamic", [])]
  for n in names:
    if MODES[n][0] == "sync":
      continue
    found = reduction_threshold(sync_points, [at_target(r["curve"], args.target)
                                              for r in by_mode[n]])
    if found is None:
      continue
    thresholds[n] = found
    if found["threshold_share"] is None:
      where = "never (it needs as many reductions as sync)"
    else:
      where = (f"{found['threshold_share']:.0%} of a sync step (arithmetic: an EMULATED "
               f"{found['added_reduction_s'] * 1e3:+.1f} ms on each reduction)")
    print(f"{n} reaches {args.target} as soon as sync-dynamic once the reduction is "
          f"{where}; measured here: {found['sync_reduction_share']:.0%}; it needed "
          f"{found['samples_ratio']:.2f}x sync's samples")
  out = {"emulated": True, "speeds": SPEEDS, "sample_ms": args.sample_ms, "target": args.target,
         "seeds": args.seeds, "budget_s": budget, "global_batch": args.global_batch,
         "wall_s": time.time() - t0, "modes": figures, "reduction_thresholds": thresholds}
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
