"""A SIMULATED synchronous cluster that drives the trainer's own `ProfilingBalancer`.

Pure numpy: "what would balancing buy on N hosts of these GPUs?" for N up to
1024 in seconds. A step ends at the last host's finish plus a hierarchical
all-reduce (NVLink, network, NVLink), not overlapped, as hetjax does.
`ASSUMPTIONS` lists what the figures rest on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from hetjax import balancer as balancer_lib
from hetjax.sim import price as price_lib

# Per-GPU ResNet-50 training throughput relative to an A100, from public
# figures (sources in BUILD_NOTES.md, "Simulator"): H100 / A100 = 14.4 / 7.8
# min to train in MLPerf Training v3.0 (two Dell 16-GPU submissions) = 1.85;
# V100 / A100 = 8.75 / 24.2 h for 90 epochs on one GPU, mixed precision
# (NVIDIA NGC ResNet-50 v1.5 MXNet performance tables) = 0.36.
GPU_SPEED = {"H100": 1.85, "A100": 1.0, "V100": 0.36}
A100_SAMPLES_PER_S = 2500.0
# Memory bandwidth (bytes/s; NVIDIA data sheets: V100 SXM2 900 GB/s, A100 40GB
# 1555 GB/s, H100 SXM 3.35 TB/s): sets the optimizer update's share of the
# per-step fixed cost.
HBM_BYTES_PER_S = {"H100": 3.35e12, "A100": 1.555e12, "V100": 0.9e12}
# NVLink bandwidth per GPU and direction (bytes/s; NVLink 2 / 3 / 4: 150 /
# 300 / 450 GB/s of the data sheets' 300 / 600 / 900 GB/s bidirectional).
NVLINK_BYTES_PER_S = {"H100": 450e9, "A100": 300e9, "V100": 150e9}
DEFAULT_MIX = ("H100", "A100", "V100", "V100")  # A cluster grown over the years.
RESNET50_PARAMS = 25.6e6

ASSUMPTIONS = (
    ("GPU speed H100 : A100 : V100", "1.85 : 1.0 : 0.36 (ResNet-50 training)", "MLPerf v3.0; NVIDIA NGC tables"),
    ("A100 throughput", "2,500 samples/s per GPU", "assumed (scale only; ratios do not move)"),
    ("hosts", "4 GPUs each, cycling H100/A100/V100/V100", "assumed mix"),
    ("global batch", "512 samples per host (weak scaling), micro-batch 16 per GPU", "assumed"),
    ("fixed cost per step", "5 ms host overhead + optimizer update (512 MB / HBM bandwidth)", "overhead assumed; HBM from data sheets"),
    ("noise", "log-normal, sigma 3 % per host and step", "assumed"),
    ("persistent slow hosts", "2 % of hosts, 1.3x slower for the whole run", "assumed"),
    ("slow spells", "rate per host-step (curve 0..1e-2), 2.5x, geometric length, mean 20 steps, independent per host", "assumed"),
    ("gradient", "102 MB (25.6 M fp32 values)", "ResNet-50"),
    ("all-reduce", "hierarchical: NVLink reduce-scatter, inter-host ring or double binary tree (the faster), NVLink all-gather; no overlap with compute", "NCCL's algorithms; hetjax reduces after the local step"),
    ("network", "25 GB/s (200 Gb/s) per host, 10 us per hop; NVLink 150/300/450 GB/s, 2 us", "assumed NIC; NVLink from data sheets"),
    ("sharding within a host", "per program run: 3 x (d-1)/d x parameter bytes / the host's NVLink (gather, backward re-gather, reduce-scatter), not overlapped", "hetjax.step.within_host's collectives; NVLink from data sheets"),
)


def mix(num_hosts: int, pattern: Sequence[str] = DEFAULT_MIX) -> tuple[str, ...]:
  """GPU class of each host, cycling through `pattern` (host 0 is the first)."""
  return tuple(pattern[i % len(pattern)] for i in range(num_hosts))


def ring_allreduce_s(num_hosts: int, nbytes: float, bandwidth: float, latency_s: float) -> float:
  """Ring all-reduce: `2 (N-1) latency + 2 (N-1)/N bytes / bandwidth`; 0 for one host."""
  n = num_hosts
  if n <= 1:
    return 0.0
  return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bandwidth


def tree_allreduce_s(num_hosts: int, nbytes: float, bandwidth: float, latency_s: float) -> float:
  """Pipelined double binary tree (NCCL): `2 log2(N) latency + 2 bytes / bandwidth`."""
  if num_hosts <= 1:
    return 0.0
  return 2 * math.ceil(math.log2(num_hosts)) * latency_s + 2 * nbytes / bandwidth


def hierarchical_allreduce_s(gpus: Sequence[str], devices_per_host: int, nbytes: float,
                             bandwidth: float, latency_s: float, *, nvlink_latency_s: float = 2e-6,
                             algorithm: str = "auto") -> float:
  """Reduce-scatter inside each host over NVLink, all-reduce between hosts, all-gather inside.

  The NVLink phases end at the slowest host's NVLink; between hosts the NIC
  carries the whole gradient. `algorithm`: 'ring', 'tree' or 'auto' (the faster, as NCCL).
  """
  d = devices_per_host
  intra = 0.0
  if d > 1:
    nvlink = min(NVLINK_BYTES_PER_S[g] for g in gpus)
    intra = (d - 1) / d * nbytes / nvlink + (d - 1) * nvlink_latency_s
  n = len(gpus)
  ring = ring_allreduce_s(n, nbytes, bandwidth, latency_s)
  tree = tree_allreduce_s(n, nbytes, bandwidth, latency_s)
  if algorithm not in ("auto", "ring", "tree"):
    raise ValueError(f"algorithm must be 'auto', 'ring' or 'tree', got {algorithm!r}.")
  inter = {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]
  return 2 * intra + inter


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """A simulated cluster: hosts, their GPUs, noise, stragglers and the network.

  Attributes:
    gpus: GPU class of each host (keys of `GPU_SPEED`).
    devices_per_host: GPUs per host.
    microbatch: samples per device per micro-batch (granularity = this x devices).
    per_host_batch: global batch = this x hosts (weak scaling).
    host_overhead_s: per-step host-side cost of a host that runs any micro-batch.
    optimizer_bytes: bytes the update moves per GPU (5 x 4 B x 25.6 M: param,
      grad, momentum read; param, momentum written).
    noise: sigma of the log-normal step-time noise.
    persistent_fraction, persistent_slowdown: share of hosts slower for the whole run, and by how much.
    straggler_rate, straggler_steps, straggler_slowdown: chance per host and step that a slow
      spell starts, its mean (geometric) length, its compute-time factor.
    spell_group: consecutive hosts that share each spell (a rack); 1 = independent.
    grad_bytes: bytes all-reduced per step (ResNet-50: 25.6 M fp32 values).
    bandwidth, latency_s: each host's network link (25 GB/s = 200 Gb/s), per-hop latency.
    algorithm: inter-host all-reduce: 'auto' (faster of ring and tree), 'ring', 'tree'.
    device_batches: blocks per device per program, one per host (None = 1); a share
      runs as full programs plus the remainder through `k/2, ..., 1` (balancer ladders).
    price: charge for micro-batch size (`hetjax.sim.price`); off, a sample costs
      the same in any micro-batch (device batch 1 everywhere).
    shard_within_host: per host, parameters split over its devices (None = off);
      each program run of a sharded host adds `within_host_s`.
    param_bytes: bytes of the parameters a sharded host gathers (ResNet-50 fp32).
    intra_host_bandwidth: bytes/s of a device's link inside a host; None = NVLink.
  """

  gpus: tuple[str, ...]
  devices_per_host: int = 4
  microbatch: int = 16
  per_host_batch: int = 512
  host_overhead_s: float = 0.005
  optimizer_bytes: float = 5 * 4 * RESNET50_PARAMS
  noise: float = 0.03
  persistent_fraction: float = 0.02
  persistent_slowdown: float = 1.3
  straggler_rate: float = 0.0005
  straggler_steps: float = 20.0
  straggler_slowdown: float = 2.5
  spell_group: int = 1
  grad_bytes: float = RESNET50_PARAMS * 4
  bandwidth: float = 25e9
  latency_s: float = 10e-6
  algorithm: str = "auto"
  device_batches: tuple[int, ...] | None = None
  price: bool = False
  shard_within_host: tuple[bool, ...] | None = None
  param_bytes: float = RESNET50_PARAMS * 4
  intra_host_bandwidth: float | None = None

  def __post_init__(self):
    unknown = sorted(set(self.gpus) - set(GPU_SPEED))
    if unknown:
      raise ValueError(f"unknown GPU class(es) {unknown}; choose from {sorted(GPU_SPEED)}.")
    if not self.gpus:
      raise ValueError("a cluster needs at least one host.")
    if self.device_batches is not None and (len(self.device_batches) != len(self.gpus)
                                            or min(self.device_batches) < 1):
      raise ValueError(f"device_batches needs one k >= 1 per host ({len(self.gpus)} hosts), got "
                       f"{list(self.device_batches)}.")
    if self.shard_within_host is not None and len(self.shard_within_host) != len(self.gpus):
      raise ValueError(f"shard_within_host needs one value per host ({len(self.gpus)} hosts), "
                       f"got {len(self.shard_within_host)}.")

  @property
  def num_hosts(self) -> int:
    return len(self.gpus)

  @property
  def global_batch(self) -> int:
    return self.per_host_batch * self.num_hosts

  @property
  def granularity(self) -> np.ndarray:
    return np.full(self.num_hosts, self.microbatch * self.devices_per_host, np.int64)

  def fixed_s(self) -> np.ndarray:
    """Per-host fixed cost of a step: host overhead + the optimizer's memory traffic."""
    return np.array([self.host_overhead_s + self.optimizer_bytes / HBM_BYTES_PER_S[g]
                     for g in self.gpus])

  def persistent(self, seed: int = 0) -> np.ndarray:
    """Per-host compute-time factor for the whole run (1 for most hosts)."""
    rng = np.random.default_rng([seed, 1])
    slow = rng.random(self.num_hosts) < self.persistent_fraction
    return np.where(slow, self.persistent_slowdown, 1.0)

  def gpu_samples_per_s(self) -> np.ndarray:
    """Per-GPU training throughput of each host at large micro-batches."""
    return np.array([GPU_SPEED[g] for g in self.gpus]) * A100_SAMPLES_PER_S

  def ladders(self) -> list[balancer_lib.Ladder] | None:
    """Each host's programs in samples with their true relative times; None where every host
    runs k = 1 unpriced."""
    if self.device_batches is None and not self.price:
      return None
    ks = self.device_batches or (1,) * self.num_hosts
    unit = self.microbatch * self.devices_per_host
    return [balancer_lib.Ladder.of(unit, k, self.program_s(h, balancer_lib.halving(k)))
            for h, k in enumerate(ks)]

  def within_host_s(self, host: int) -> float:
    """Seconds each program run of `host` spends in within-host sharding's collectives.

    Gather (forward), gather again (backward) and reduce-scatter (gradients),
    each `(d - 1) / d` of the parameter bytes, not overlapped (an upper bound).
    """
    d = self.devices_per_host
    if not (self.shard_within_host and self.shard_within_host[host]) or d < 2:
      return 0.0
    link = self.intra_host_bandwidth or NVLINK_BYTES_PER_S[self.gpus[host]]
    return 3 * (d - 1) / d * self.param_bytes / link

  def program_s(self, host: int, sizes: Sequence[int]) -> list[float]:
    """True seconds of one run of each program of `sizes` blocks per device on `host`."""
    gpu, thr = self.gpus[host], float(self.gpu_samples_per_s()[host])
    extra = self.within_host_s(host)
    if not self.price:
      return [k * self.microbatch / thr + extra for k in sizes]
    return [price_lib.program_s(thr, k * self.microbatch, HBM_BYTES_PER_S[gpu],
                                3 * self.grad_bytes) + extra for k in sizes]

  def costs(self, seed: int | None = None) -> balancer_lib.CostParams:
    """The true (noise-free) cost of every host; with `seed`, its persistent slow hosts too."""
    factor = np.ones(self.num_hosts) if seed is None else self.persistent(seed)
    ladders = self.ladders()
    if ladders is None:  # One program run per round of `granularity` samples.
      speed = self.gpu_samples_per_s() * self.devices_per_host
      gathers = np.array([self.within_host_s(h) for h in range(self.num_hosts)])
      return balancer_lib.CostParams(self.fixed_s() * factor,
                                     factor / speed + factor * gathers / self.granularity,
                                     self.granularity)
    # Seconds per work unit: the one-round program's time over its units.
    one_round = np.array([self.program_s(h, [1])[0] for h in range(self.num_hosts)])
    per_unit = one_round / self.granularity
    return balancer_lib.CostParams(self.fixed_s() * factor, factor * per_unit, self.granularity,
                                   balancer_lib.Ladders(ladders))

  def comm_s(self) -> float:
    return hierarchical_allreduce_s(self.gpus, self.devices_per_host, self.grad_bytes,
                                    self.bandwidth, self.latency_s, algorithm=self.algorithm)


def noise_factors(spec: ClusterSpec, steps: int, seed: int = 0) -> np.ndarray:
  """`[steps, hosts]` log-normal step-time noise."""
  return np.exp(spec.noise * np.random.default_rng([seed, 2]).standard_normal((steps, spec.num_hosts)))


def spell_factors(spec: ClusterSpec, steps: int, seed: int = 0) -> np.ndarray:
  """`[steps, hosts]` transient slow spells: starts at `straggler_rate`, geometric lengths;
  with `spell_group` k > 1 a spell slows a group of k hosts at once (as often as alone)."""
  rng = np.random.default_rng([seed, 3])
  k = max(int(spec.spell_group), 1)
  groups = -(-spec.num_hosts // k)
  starts = rng.random((steps, groups)) < spec.straggler_rate
  lengths = rng.geometric(1.0 / max(spec.straggler_steps, 1.0), size=(steps, groups))
  slow = np.zeros((steps, groups), bool)
  for s, h in zip(*np.nonzero(starts)):  # Few starts: loop over them, not over steps.
    slow[s:s + lengths[s, h], h] = True
  slow = np.repeat(slow, k, axis=1)[:, :spec.num_hosts]
  return np.where(slow, spec.straggler_slowdown, 1.0)


def fresh_spells(spec: ClusterSpec, steps: int, seed: int, within: int) -> np.ndarray:
  """`[steps, hosts]`: True where a host is in a slow spell that began at most `within` steps ago."""
  slow = spell_factors(spec, steps, seed) > 1.0
  began = slow & ~np.vstack([np.zeros((1, spec.num_hosts), bool), slow[:-1]])
  fresh = np.zeros_like(slow)
  for lag in range(within + 1):
    fresh |= np.vstack([np.zeros((lag, spec.num_hosts), bool), began[:steps - lag]])
  return fresh & slow


def slowdowns(spec: ClusterSpec, steps: int, seed: int = 0) -> np.ndarray:
  """`[steps, hosts]` compute-time factors: noise times slow spells (persistent slow hosts
  are in `spec.costs(seed)`, so a noise-free optimum can be computed for them)."""
  return noise_factors(spec, steps, seed) * spell_factors(spec, steps, seed)


def make(mode: str, spec: ClusterSpec, **options: Any) -> balancer_lib.Balancer:
  """The balancer for `mode` ('equal', 'static', 'dynamic') on `spec`'s cluster."""
  if mode in ("static", "dynamic") and spec.ladders() is not None:
    # The step half times each program at start; the balancer gets those times.
    options.setdefault("ladders", spec.ladders())
  return balancer_lib.make_balancer("equal", spec.global_batch, spec.num_hosts, mode=mode,
                                    granularity=spec.granularity.tolist(), **options)


def optimal_shares(spec: ClusterSpec, seed: int | None = None) -> tuple[int, ...]:
  """The noise-free optimum: the exact solver on the true costs (persistent hosts included)."""
  true = spec.costs(seed)
  return balancer_lib.solve(spec.global_batch, true.fixed_s, true.per_sample_s, spec.granularity,
                            ladders=true.ladders)


@dataclasses.dataclass
class SimResult:
  """What a simulated run measured (simulated seconds)."""

  mode: str
  num_hosts: int
  samples_per_s: float
  step_s: np.ndarray
  compute_s: np.ndarray  # [steps, hosts]
  shares: list[tuple[int, ...]]
  decisions: list[dict[str, Any]]


def simulate(spec: ClusterSpec, bal: balancer_lib.Balancer, steps: int = 60, *,
             measure_from: int = 10, seed: int = 0,
             factors: np.ndarray | None = None, comm: bool = True,
             costs: balancer_lib.CostParams | None = None,
             comm_s: float | None = None) -> SimResult:
  """Runs `steps` synchronous steps; throughput counts steps from `measure_from`.

  One `seed` gives every mode the same noise and slow hosts. `comm=False` leaves the
  all-reduce out; `costs` and `comm_s` replace the GPU-class model with measured
  values (bench/validate_sim.py).
  """
  if not 0 <= measure_from < steps:
    raise ValueError(f"measure_from ({measure_from}) must be in [0, steps={steps}).")
  true = spec.costs(seed) if costs is None else costs
  factors = slowdowns(spec, steps, seed) if factors is None else factors
  comm_s = (spec.comm_s() if comm_s is None else comm_s) if comm else 0.0
  step_s, seen = np.zeros(steps), []
  compute_all = np.zeros((steps, spec.num_hosts))
  for step in range(steps):
    shares = bal.shares(step)
    compute = true.predict(shares) * factors[step]
    # The collective starts at the last host's arrival.
    step_s[step] = float(compute.max()) + comm_s
    compute_all[step] = compute
    seen.append(tuple(shares))
    bal.observe(step, shares, compute.tolist())  # The timing vector rides the collective.
  rate = spec.global_batch * (steps - measure_from) / float(step_s[measure_from:].sum())
  return SimResult(bal.name, spec.num_hosts, rate, step_s, compute_all, seen,
                   list(getattr(bal, "decisions", [])))


def single_host_samples_per_s(spec: ClusterSpec, gpu: str) -> float:
  """Noise-free throughput of one host of class `gpu` alone (no collective)."""
  one = dataclasses.replace(spec, gpus=(gpu,))
  return one.per_host_batch / float(one.costs().predict([one.per_host_batch])[0])


def ideal_samples_per_s(spec: ClusterSpec, seed: int | None = None) -> float:
  """Sum of the hosts' own noise-free throughputs at `per_host_batch`: no collective, no waiting."""
  true = spec.costs(seed)
  b = np.full(spec.num_hosts, spec.per_host_batch)
  return float(np.sum(b / true.predict(b)))


def auto_device_batches(spec: ClusterSpec, fraction: float = price_lib.MEMORY_FRACTION
                        ) -> tuple[int, ...]:
  """Per host, `auto`'s device batch: the largest k that fits memory and is as fast (`price`)."""
  priced = dataclasses.replace(spec, price=True, device_batches=None)
  return tuple(price_lib.auto_device_batch(g, spec.microbatch,
                                           lambda k, h=h: priced.program_s(h, [k])[0], fraction)
               for h, g in enumerate(spec.gpus))


def ideal_best_device_batch_samples_per_s(spec: ClusterSpec, seed: int | None = None,
                                          fraction: float = price_lib.MEMORY_FRACTION) -> float:
  """Sum of the hosts' own throughputs at `per_host_batch`, each alone at its best
  per-device micro-batch (any size that fits memory: the bound of any `m` and `k`)."""
  priced = dataclasses.replace(spec, price=True)
  factor = np.ones(spec.num_hosts) if seed is None else spec.persistent(seed)
  fixed, thr = spec.fixed_s(), priced.gpu_samples_per_s()
  total = 0.0
  for h, gpu in enumerate(spec.gpus):
    best = np.inf
    for s in range(1, price_lib.max_microbatch(gpu, fraction) + 1):
      runs = -(-spec.per_host_batch // (s * spec.devices_per_host))
      t = runs * price_lib.program_s(float(thr[h]), s, HBM_BYTES_PER_S[gpu], 3 * spec.grad_bytes)
      best = min(best, fixed[h] + t)
    total += spec.per_host_batch / (best * factor[h])
  return float(total)
