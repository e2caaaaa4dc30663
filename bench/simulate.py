"""SIMULATED speedups of equal / static / dynamic splits on 1..1024 mixed-GPU hosts.

Run: `.venv/bin/python bench/simulate.py` (about 3 minutes on 2 shared cores;
`--quick` for a smaller grid). Nothing here runs on a GPU: the cluster is
`hetjax.sim.sync` (GPU speed ratios, per-class fixed costs, noise, persistent slow
hosts, slow spells, hierarchical all-reduce) driving the real
`hetjax.balancer`. Every figure is SIMULATED; the assumptions are printed
first, as one table. Prints, per size: the speedup table; simulated hybrid
rounds (`hetjax.sim.rounds`, H = 4 and 8) next to the synchronous rows at
16 and 1024 hosts, against EDDIS's figures (throughput only, not
statistical efficiency); the breakdown
ideal -> minus communication -> minus noise -> minus stragglers; curves over
the slow-spell rate with the spread over seeds; which assumptions move the
1024-host figure. The last line is one JSON object with the figures.
For the replay of the emulated 3-host cluster see bench/validate_sim.py.

`--device-batches` (a few seconds) prices the micro-batch size
(`hetjax.sim.price`: throughput that saturates with the per-device
micro-batch, fitted to NVIDIA's published ResNet-50 figures, plus a cost per
program run) at 16 hosts x 8 GPUs, 512 samples per host, and prints: the
equal split, each single block size m in 8, 16, 32, 64 with k = 1, and m = 8
with per-host `auto` device batches, next to the bound; then the speedups
over one node of each mode. Its last line is the ratio of m = 8 with auto
device batches (dynamic balancer) over the best single m with k = 1, and the
fraction of the ideal it reaches.

`--mode-threshold R` (a few seconds) sweeps the link bandwidth at 16 hosts
and prints the reduction's share of a sync step above which hybrid's
SIMULATED throughput over sync-dynamic's passes R, the samples-to-target
ratio bench/modes.py MEASURED: there hybrid reaches the target first.

`--within-host` (a few seconds) prices `--shard-within-host` at 16 hosts:
each GPU class sharding alone, its added seconds per program run and the
dynamic split's samples/s against none sharding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

from hetjax import balancer
from hetjax.sim import sync as sim
from hetjax.sim import price as sim_price
from hetjax.sim import rounds as sim_rounds

HOSTS = (1, 2, 4, 8, 16, 64, 256, 1024)
MODES = ("equal", "static", "dynamic")
RATES = (0.0, 1e-4, 1e-3, 3e-3, 1e-2)
DEFAULT_RATE = 5e-4
EDDIS_16 = {"synchronous": 8.2, "asynchronous": 19.0, "hybrid": 18.7}  # ANCHORS.md, over 1 node.
ROUND_STEPS = (4, 8)  # H of the simulated hybrid rows.
THROUGHPUT_ONLY = "simulated; throughput, not statistical efficiency"


def rates_over_seeds(spec: sim.ClusterSpec, mode: str, steps: int, seeds, **kw) -> np.ndarray:
  """Samples/s of `mode` on `spec` for each seed (identical conditions across modes)."""
  out = []
  for seed in seeds:
    bal = (balancer.FixedBalancer(sim.optimal_shares(spec, seed), name="oracle")
           if mode == "oracle" else sim.make(mode, spec))
    out.append(sim.simulate(spec, bal, steps, seed=seed, **kw).samples_per_s)
  return np.asarray(out)


def fmt(values: np.ndarray, scale: float) -> str:
  v = values / scale
  return f"{v.mean():8.2f} [{v.min():.2f}-{v.max():.2f}]"


def speedup_table(steps: int, seeds, hosts) -> dict:
  print(f"\nSpeedup over ONE fastest (H100) host, SIMULATED, slow-spell rate {DEFAULT_RATE:g} "
        f"per host-step; mean [min-max] over {len(seeds)} seeds x {steps} steps:")
  print(f"{'hosts':>6} " + " ".join(f"{m:>21}" for m in MODES) + f" {'ideal':>8} {'comm ms':>8}")
  rows = {}
  for n in hosts:
    spec = sim.ClusterSpec(sim.mix(n), straggler_rate=DEFAULT_RATE)
    fastest = sim.single_host_samples_per_s(spec, "H100")
    r = {m: rates_over_seeds(spec, m, steps, seeds) / fastest for m in MODES}
    ideal = np.mean([sim.ideal_samples_per_s(spec, s) for s in seeds]) / fastest
    rows[n] = {**{m: float(v.mean()) for m, v in r.items()},
               **{f"{m}_min": float(v.min()) for m, v in r.items()},
               **{f"{m}_max": float(v.max()) for m, v in r.items()},
               "ideal": float(ideal), "comm_ms": spec.comm_s() * 1e3}
    print(f"{n:>6} " + " ".join(fmt(r[m], 1.0).rjust(21) for m in MODES)
          + f" {ideal:>8.2f} {spec.comm_s() * 1e3:>8.2f}   simulated")
  print("  ideal = sum of the hosts' own noise-free throughputs: no collective, no waiting.")
  return rows


def mean_node_samples_per_s(spec: sim.ClusterSpec) -> float:
  """One average node of the mix alone: the closest reading of EDDIS's "1 node" baseline."""
  return float(np.mean([sim.single_host_samples_per_s(spec, g) for g in spec.gpus]))


def hybrid_table(rows: dict, steps: int, seeds, hosts=(16, 1024)) -> dict:
  """Hybrid rounds (H = 4, 8) next to the synchronous rows: throughput speedups over one node."""
  print(f"\nHybrid rounds next to the synchronous rows, SIMULATED: THROUGHPUT ONLY, not statistical "
        f"efficiency (a round of local steps is not a sync step; bench/modes.py measures time to "
        f"accuracy). Mean [min-max] over {len(seeds)} seeds; hybrid: {steps} rounds, tau = "
        f"max(1, round(H v_i / v_max)), 512 samples per local step, one all-reduce per round. "
        f"Over one H100 host (as above) and over one average node of the mix (EDDIS's baseline "
        f"is one node of a GPU mix it does not state; perfect scaling over the average node = "
        f"hosts x):")
  print(f"{'hosts':>6} {'mode':<12} {'tau H100/A100/V100':>18} {'over 1 H100 host':>22} "
        f"{'over avg node':>13} {'EDDIS, 16 nodes over 1':>24}")
  out = {}
  for n in hosts:
    spec = sim.ClusterSpec(sim.mix(n), straggler_rate=DEFAULT_RATE)
    fastest, avg = sim.single_host_samples_per_s(spec, "H100"), mean_node_samples_per_s(spec)
    eddis_sync = f"{EDDIS_16['synchronous']:g}x sync" if n == 16 else "-"
    eddis_hyb = (f"{EDDIS_16['hybrid']:g}x hybrid, {EDDIS_16['asynchronous']:g}x async"
                 if n == 16 else "-")
    lines = {f"sync {m}": (np.array([rows[n][f"{m}_min"], rows[n][m], rows[n][f"{m}_max"]]),
                           "-", eddis_sync) for m in ("equal", "dynamic")}
    step_s = spec.costs().predict(np.full(n, spec.per_host_batch))
    for h in ROUND_STEPS:
      r = np.array([sim_rounds.simulate_rounds(spec, h, steps, seed=s).samples_per_s
                    for s in seeds]) / fastest
      taus = sim_rounds.taus_from_speeds(h, step_s)
      lines[f"hybrid H={h}"] = (np.array([r.min(), r.mean(), r.max()]),
                                "/".join(map(str, taus[:3])), eddis_hyb)
    out[n] = {}
    for name, (v, taus, eddis) in lines.items():
      over_avg = v[1] * fastest / avg
      out[n][name] = {"over_h100": round(float(v[1]), 3), "over_h100_min": round(float(v[0]), 3),
                      "over_h100_max": round(float(v[2]), 3), "over_avg_node": round(float(over_avg), 2)}
      cell = f"{v[1]:.2f} [{v[0]:.2f}-{v[2]:.2f}]"
      print(f"{n:>6} {name:<12} {taus:>18} {cell:>22} {over_avg:>13.2f} {eddis:>24}   "
            f"{THROUGHPUT_ONLY}")
  h16 = out[16] if 16 in out else None
  if h16:
    best = max(ROUND_STEPS, key=lambda h: h16[f"hybrid H={h}"]["over_h100"])
    ratio = h16[f"hybrid H={best}"]["over_h100"] / h16["sync equal"]["over_h100"]
    print(f"  16 hosts: hybrid H={best} / sync equal {ratio:.2f}x against EDDIS's hybrid / sync "
          f"{EDDIS_16['hybrid'] / EDDIS_16['synchronous']:.2f}x; only such ratios compare (EDDIS's "
          f"19x and 18.7x exceed the 16x of perfect scaling over an average node).   "
          f"{THROUGHPUT_ONLY}")
    print(f"  Elastic rounds cost what hybrid's do here (one reduction of the parameters per "
          f"round); EDDIS's async mode has no barrier at all.   {THROUGHPUT_ONLY}")
    out["hosts16_best_hybrid_over_sync_equal"] = round(float(ratio), 3)
  what_if = {}
  for n in hosts:
    spec = sim.ClusterSpec(sim.mix(n), straggler_rate=DEFAULT_RATE)
    r = np.mean([sim_rounds.simulate_rounds(spec, 8, steps, seed=s, speed_window=1).samples_per_s
                 for s in seeds]) / sim.single_host_samples_per_s(spec, "H100")
    what_if[n] = round(float(r), 3)
  print(f"  What-if, not what hetjax does (its TauPolicy takes the median of "
        f"{sim_rounds.SPEED_WINDOW} rounds): hybrid H=8 with tau from the last round's times only: "
        + ", ".join(f"{n} hosts {v:.2f}x one H100 host" for n, v in what_if.items())
        + f".   {THROUGHPUT_ONLY}")
  out["what_if_hybrid8_window1_over_h100"] = {str(n): v for n, v in what_if.items()}
  return out


def breakdown(n: int, steps: int, seeds) -> dict:
  """ideal -> minus communication -> minus noise -> minus stragglers (dynamic balancer)."""
  base = sim.ClusterSpec(sim.mix(n), straggler_rate=DEFAULT_RATE)
  fastest = sim.single_host_samples_per_s(base, "H100")
  quiet = dataclasses.replace(base, noise=0.0, straggler_rate=0.0)
  noisy = dataclasses.replace(base, straggler_rate=0.0)
  stages = {
      "ideal (sum of own throughputs)": np.mean([sim.ideal_samples_per_s(base, s) for s in seeds]),
      "- communication (optimal split, no noise)": rates_over_seeds(quiet, "oracle", steps, seeds).mean(),
      "- noise (dynamic balancer, 3 % noise)": rates_over_seeds(noisy, "dynamic", steps, seeds).mean(),
      f"- stragglers (slow spells at {DEFAULT_RATE:g})": rates_over_seeds(base, "dynamic", steps, seeds).mean(),
  }
  print(f"\nBreakdown at {n} hosts, SIMULATED (speedup over one H100 host; each line adds one effect):")
  prev, out = None, {}
  for name, v in stages.items():
    x = v / fastest
    lost = "" if prev is None else f"  ({x / prev - 1:+.1%})"
    print(f"  {name:<45} {x:8.2f}{lost}   simulated")
    out[name] = round(float(x), 3)
    prev = x
  return out


def straggler_curves(n: int, steps: int, seeds) -> dict:
  spec0 = sim.ClusterSpec(sim.mix(n))
  fastest = sim.single_host_samples_per_s(spec0, "H100")
  print(f"\nSpeedup over one H100 host vs slow-spell rate, {n} hosts, SIMULATED "
        f"(mean [min-max] over {len(seeds)} seeds):")
  print(f"{'rate':>8} " + " ".join(f"{m:>21}" for m in MODES) + f" {'dyn/static':>11}")
  curves = {}
  for rate in RATES:
    spec = dataclasses.replace(spec0, straggler_rate=rate)
    r = {m: rates_over_seeds(spec, m, steps, seeds) for m in MODES}
    ratio = r["dynamic"] / r["static"]
    curves[str(rate)] = {m: [round(float(v), 3) for v in r[m] / fastest] for m in MODES}
    print(f"{rate:>8g} " + " ".join(fmt(r[m], fastest).rjust(21) for m in MODES)
          + f" {ratio.min():>5.3f}-{ratio.max():.3f}   simulated")
  return curves


def sensitivity(n: int, steps: int, seeds) -> dict:
  """How far each assumption moves the dynamic figure at `n` hosts."""
  base = sim.ClusterSpec(sim.mix(n), straggler_rate=DEFAULT_RATE)
  ref = rates_over_seeds(base, "dynamic", steps, seeds).mean()
  variants = {
      "bandwidth x0.5": dict(bandwidth=base.bandwidth / 2),
      "bandwidth x2": dict(bandwidth=base.bandwidth * 2),
      "flat ring between hosts": dict(algorithm="ring"),
      "host overhead 2.5 ms": dict(host_overhead_s=0.0025),
      "host overhead 10 ms": dict(host_overhead_s=0.010),
      "noise 1 %": dict(noise=0.01),
      "noise 6 %": dict(noise=0.06),
      "no persistent slow hosts": dict(persistent_fraction=0.0),
      "slow-spell rate 1e-3": dict(straggler_rate=1e-3),
      "slow-spell rate 1e-2": dict(straggler_rate=1e-2),
      "slow spells 1.5x": dict(straggler_slowdown=1.5),
      "spells hit racks of 8 hosts": dict(spell_group=8),
  }
  print(f"\nWhat moves the {n}-host dynamic figure, SIMULATED (change vs the defaults):")
  out = {}
  for name, kw in variants.items():
    v = rates_over_seeds(dataclasses.replace(base, **kw), "dynamic", steps, seeds).mean()
    out[name] = round(float(v / ref - 1), 3)
    print(f"  {name:<28} {v / ref - 1:+7.1%}   simulated")
  return out


def solve_time_ms(n: int = 1024, repeats: int = 21) -> float:
  spec = sim.ClusterSpec(sim.mix(n))
  c = spec.costs()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    balancer.solve(spec.global_batch, c.fixed_s, c.per_sample_s, spec.granularity)
    times.append(time.perf_counter() - t)
  return float(np.median(times) * 1e3)


BLOCK_SIZES = (8, 16, 32, 64)


def device_batch_configs(base: sim.ClusterSpec) -> dict[str, sim.ClusterSpec]:
  """Each single m with k = 1, and m = 8 with every host's `auto` device batch (all priced)."""
  configs = {f"m={m}, k=1": dataclasses.replace(base, microbatch=m) for m in BLOCK_SIZES}
  m8 = dataclasses.replace(base, microbatch=8)
  configs["m=8, k=auto"] = dataclasses.replace(m8, device_batches=sim.auto_device_batches(m8))
  return configs


def device_batch_table(steps: int, seeds, hosts: int = 16, devices: int = 8,
                       per_host: int = 512) -> dict:
  """Issue 27's figure: block size against device batch, with the micro-batch priced."""
  base = sim.ClusterSpec(sim.mix(hosts), devices_per_host=devices, per_host_batch=per_host,
                         straggler_rate=DEFAULT_RATE, price=True)
  configs = device_batch_configs(base)
  ideal = float(np.mean([sim.ideal_best_device_batch_samples_per_s(base, s) for s in seeds]))
  one = {g: sim.ideal_best_device_batch_samples_per_s(dataclasses.replace(base, gpus=(g,)))
         for g in sorted(set(base.gpus))}
  node = float(np.mean([one[g] for g in base.gpus]))  # One average node of the mix, alone.
  ks = configs["m=8, k=auto"].device_batches
  print(f"\nBlock size m against device batch k, micro-batch PRICED, SIMULATED: {hosts} hosts x "
        f"{devices} GPUs ({'/'.join(sim.DEFAULT_MIX)}), {per_host} samples per host, slow-spell "
        f"rate {DEFAULT_RATE:g}; mean [min-max] samples/s over {len(seeds)} seeds x {steps} steps. "
        f"auto device batches at m = 8: " + ", ".join(
            f"{g} k={k}" for g, k in dict(zip(base.gpus, ks)).items()) + ".")
  print(f"{'configuration':<14} " + " ".join(f"{m:>24}" for m in MODES))
  rates = {}
  for name, spec in configs.items():
    r = {m: rates_over_seeds(spec, m, steps, seeds) for m in MODES}
    rates[name] = {m: float(v.mean()) for m, v in r.items()}
    print(f"{name:<14} " + " ".join(fmt(r[m], 1.0).rjust(24) for m in MODES) + "   simulated")
  print(f"{'bound':<14} {ideal:>24.0f}   simulated: the sum of each host's own throughput at "
        f"its best device batch (alone, no collective, no waiting)")
  print(f"\nSpeedup over ONE node at {hosts} nodes, SIMULATED, micro-batch priced (one node = "
        f"the mean of the mix's nodes alone at their best device batch, {node:.0f} samples/s):")
  print(f"{'configuration':<14} " + " ".join(f"{m:>9}" for m in MODES) + f" {'ideal':>9}")
  for name, r in rates.items():
    print(f"{name:<14} " + " ".join(f"{r[m] / node:>9.2f}" for m in MODES)
          + f" {ideal / node:>9.2f}   simulated")
  # The best k = 1 configuration under either balancer, against auto under the dynamic one.
  best_k1 = max(((n, m) for n in rates if n.endswith("k=1") for m in ("static", "dynamic")),
                key=lambda nm: rates[nm[0]][nm[1]])
  auto = rates["m=8, k=auto"]["dynamic"]
  ratio, frac = auto / rates[best_k1[0]][best_k1[1]], auto / ideal
  best_k1 = f"{best_k1[0]}, {best_k1[1]}"
  return {"rates": rates, "ideal": ideal, "one_node": node, "auto_k": list(ks),
          "best_k1": best_k1, "ratio": ratio, "fraction_of_ideal": frac}


def device_batches_main(steps: int, seeds) -> dict:
  print("SIMULATED cluster (hetjax.sim.sync driving hetjax.balancer), micro-batch priced. "
        "Assumptions:")
  print(f"  {'what':<30} {'value':<70} source")
  for what, value, source in sim.ASSUMPTIONS + sim_price.ASSUMPTIONS:
    print(f"  {what:<30} {value:<70} {source}")
  out = device_batch_table(steps, seeds)
  print(f"SIMULATED, 16 hosts x 8 GPUs, 512 samples per host: m = 8 with auto device batches "
        f"(dynamic) / best single m with k = 1 ({out['best_k1']}) = {out['ratio']:.2f}x; "
        f"it reaches {out['fraction_of_ideal']:.1%} of the ideal.")
  return out


BANDWIDTHS = (100e9, 25e9, 10e9, 5e9, 2.5e9, 1e9, 0.5e9, 0.25e9)  # bytes/s per host link


def mode_threshold(samples_ratio: float, steps: int, seeds, hosts: int = 16) -> dict:
  """The reduction's share of a sync step above which hybrid reaches a target first.

  A mode reaches a target when it has processed the samples it needs, so
  hybrid (H = 4, 8) wins on time when its throughput over sync-dynamic's
  exceeds `samples_ratio`, the samples it needs over sync's (measured on a
  real model by bench/modes.py). The link's bandwidth is swept, which moves
  the all-reduce's share of a balanced sync step; the share where the
  throughput ratio first passes `samples_ratio` is the threshold.
  """
  print(f"\nMode threshold, SIMULATED throughput x MEASURED samples-to-target ratio "
        f"{samples_ratio:.2f} (bench/modes.py): {hosts} hosts of the default mix, the link's "
        f"bandwidth swept; hybrid reaches a target first where hybrid / sync-dynamic samples/s "
        f"> {samples_ratio:.2f}.")
  print(f"{'link GB/s':>10} {'reduction share':>16} " + " ".join(
      f"{f'hybrid H={h} / sync':>18}" for h in ROUND_STEPS))
  rows, threshold = [], {h: None for h in ROUND_STEPS}
  for bandwidth in BANDWIDTHS:
    spec = sim.ClusterSpec(sim.mix(hosts), straggler_rate=DEFAULT_RATE, bandwidth=bandwidth)
    runs = [sim.simulate(spec, sim.make("dynamic", spec), steps, seed=s) for s in seeds]
    sync_rate = float(np.mean([r.samples_per_s for r in runs]))
    share = spec.comm_s() / float(np.mean([r.step_s[10:].mean() for r in runs]))
    ratios = {h: float(np.mean([sim_rounds.simulate_rounds(spec, h, steps, seed=s).samples_per_s
                                for s in seeds])) / sync_rate for h in ROUND_STEPS}
    for h, ratio in ratios.items():
      if threshold[h] is None and ratio > samples_ratio:
        threshold[h] = share
    rows.append({"bandwidth_gb_s": bandwidth / 1e9, "reduction_share": round(share, 3),
                 **{f"hybrid{h}_over_sync": round(r, 3) for h, r in ratios.items()}})
    print(f"{bandwidth / 1e9:>10g} {share:>16.1%} " + " ".join(
        f"{ratios[h]:>18.2f}" for h in ROUND_STEPS))
  found = {h: (f"{t:.0%}" if t is not None else "none in the sweep") for h, t in threshold.items()}
  print("Threshold (SIMULATED): hybrid first once the reduction is at least "
        + ", ".join(f"H={h}: {v}" for h, v in found.items()) + " of a sync step.")
  out = {"simulated": True, "samples_ratio": samples_ratio, "hosts": hosts, "rows": rows,
         "threshold_share": {str(h): t for h, t in threshold.items()}}
  print(json.dumps(out))
  return out


def within_host_table(steps: int, seeds, hosts: int = 16) -> dict:
  """Sync-dynamic with each GPU class sharding within its hosts, against none sharding."""
  base = sim.ClusterSpec(sim.mix(hosts), straggler_rate=DEFAULT_RATE)
  rate = lambda spec: float(np.mean(rates_over_seeds(spec, "dynamic", steps, seeds)))
  out = {"simulated": True, "hosts": hosts, "off": rate(base)}
  for gpu in sim_price.MEMORY_GB:
    spec = dataclasses.replace(base, shard_within_host=tuple(g == gpu for g in base.gpus))
    h = base.gpus.index(gpu)
    out[gpu] = {"per_program_run_ms": round(spec.within_host_s(h) * 1e3, 3),
                "samples_per_s": rate(spec)}
    print(f"SIMULATED, {hosts} hosts: {gpu} hosts shard within the host: +"
          f"{out[gpu]['per_program_run_ms']} ms per program run (3 x (d-1)/d x "
          f"{base.param_bytes / 1e6:.0f} MB / NVLink); dynamic {out[gpu]['samples_per_s']:.0f} "
          f"against {out['off']:.0f} samples/s with none sharding")
  print(json.dumps(out))
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=80)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--quick", action="store_true", help="16 and 1024 hosts only, 40 steps")
  p.add_argument("--device-batches", action="store_true",
                 help="only the device-batch figure: block size m against per-host device batches, "
                      "with the micro-batch priced (16 hosts x 8 GPUs)")
  p.add_argument("--mode-threshold", type=float, default=None, metavar="SAMPLES_RATIO",
                 help="only the sync/hybrid threshold: the reduction share above which hybrid "
                      "reaches a target first, given hybrid's samples-to-target over sync's "
                      "(bench/modes.py prints it)")
  p.add_argument("--within-host", action="store_true",
                 help="only the price of sharding within a host: each GPU class sharding alone")
  args = p.parse_args(argv)
  steps = 40 if args.quick else args.steps
  seeds = tuple(range(args.seeds))
  if args.mode_threshold is not None:
    if args.mode_threshold <= 0:
      p.error(f"--mode-threshold must be > 0 (hybrid's samples to a target over sync's, e.g. "
              f"1.3), got {args.mode_threshold}.")
    return mode_threshold(args.mode_threshold, steps, seeds)
  if args.device_batches:
    return device_batches_main(steps, seeds)
  if args.within_host:
    return within_host_table(steps, seeds)
  hosts = (16, 1024) if args.quick else HOSTS
  t0 = time.time()
  print("SIMULATED cluster (hetjax.sim.sync driving hetjax.balancer). Assumptions:")
  print(f"  {'what':<30} {'value':<70} source")
  for what, value, source in sim.ASSUMPTIONS + sim_rounds.ASSUMPTIONS:
    print(f"  {what:<30} {value:<70} {source}")
  rows = speedup_table(steps, seeds, hosts)
  hybrid = hybrid_table(rows, steps, seeds)
  parts = {n: breakdown(n, steps, seeds) for n in (16, 1024)}
  curves = {n: straggler_curves(n, steps, seeds) for n in (16, 1024)}
  sens = sensitivity(1024, steps, seeds)

  r16 = rows[16]
  spec16 = sim.ClusterSpec(sim.mix(16))
  mean_node = mean_node_samples_per_s(spec16)
  over_mean = r16["dynamic"] * sim.single_host_samples_per_s(spec16, "H100") / mean_node
  gain = r16["dynamic"] / r16["equal"]
  print(f"\n16 hosts, SIMULATED, next to EDDIS (IEEE BigData 2024; 16 heterogeneous nodes, GPU mix "
        f"not stated): balanced / equal synchronous {gain:.2f}x against EDDIS's asynchronous / "
        f"synchronous {EDDIS_16['asynchronous'] / EDDIS_16['synchronous']:.2f}x; over one average "
        f"node of the mix {over_mean:.1f}x of a perfect 16x. Only ratios compare.")
  solve_ms = solve_time_ms()
  print(f"balancer.solve for 1024 hosts: {solve_ms:.2f} ms (median of 21); run took "
        f"{time.time() - t0:.0f} s")
  result = {"simulated": True, "steps": steps, "seeds": len(seeds), "default_rate": DEFAULT_RATE,
            "speedup_over_fastest_host": {str(n): {k: round(v, 3) for k, v in r.items()}
                                          for n, r in rows.items()},
            "hybrid_rounds_throughput_only": {str(n): v for n, v in hybrid.items()},
            "breakdown": {str(n): v for n, v in parts.items()},
            "straggler_curves": {str(n): v for n, v in curves.items()},
            "sensitivity_1024_dynamic": sens, "hosts16_dynamic_over_equal": round(gain, 3),
            "hosts16_dynamic_over_mean_node": round(float(over_mean), 2), "eddis_16": EDDIS_16,
            "solve_1024_ms": round(solve_ms, 3)}
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
