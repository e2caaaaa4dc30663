"""A simulated synchronous data-parallel cluster that drives the real balancer.

Pure numpy, no JAX: it answers "what would balancing buy on N hosts of these
GPUs?" for N up to 1024 in seconds, with the very `ProfilingBalancer` the
trainer uses. Each step is a small discrete-event sequence: every host
finishes its local compute at its own time, the step's barrier falls at the
last finish, then a ring all-reduce runs. Everything here is SIMULATED.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from hetjax import balancer as balancer_lib

# Per-GPU ResNet-50 training throughput relative to an A100, from public
# figures (sources in BUILD_NOTES.md, "Simulator"): H100 / A100 = 14.4 / 7.8
# min to train in MLPerf Training v3.0 (two Dell 16-GPU submissions) = 1.85;
# V100 / A100 = 8.75 / 24.2 h for 90 epochs on one GPU, mixed precision
# (NVIDIA NGC ResNet-50 v1.5 MXNet performance tables) = 0.36.
GPU_SPEED = {"H100": 1.85, "A100": 1.0, "V100": 0.36}
A100_SAMPLES_PER_S = 2500.0
DEFAULT_MIX = ("H100", "A100", "V100", "V100")  # A cluster grown over the years.


def mix(num_hosts: int, pattern: Sequence[str] = DEFAULT_MIX) -> tuple[str, ...]:
  """GPU class of each host, cycling through `pattern` (host 0 is the first)."""
  return tuple(pattern[i % len(pattern)] for i in range(num_hosts))


def ring_allreduce_s(num_hosts: int, nbytes: float, bandwidth: float, latency_s: float) -> float:
  """Ring all-reduce: `2 (N-1) latency + 2 (N-1)/N bytes / bandwidth`; 0 for one host."""
  n = num_hosts
  if n <= 1:
    return 0.0
  return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * nbytes / bandwidth


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """A simulated cluster: hosts, their GPUs, noise, stragglers and the network.

  Attributes:
    gpus: GPU class of each host (keys of `GPU_SPEED`).
    devices_per_host: GPUs per host.
    microbatch: samples per device per micro-batch (granularity = this x devices).
    per_host_batch: global batch = this x hosts (weak scaling).
    fixed_s: per-step local overhead of a host that runs any micro-batch.
    noise: sigma of the log-normal step-time noise.
    straggler_rate: chance per host and step that a slow spell starts.
    straggler_steps: length of a slow spell.
    straggler_slowdown: compute-time factor during a slow spell.
    grad_bytes: bytes all-reduced per step (ResNet-50: 25.6 M fp32 values).
    bandwidth: bytes/s of each ring link (25 GB/s = 200 Gb/s).
    latency_s: per-hop latency.
  """

  gpus: tuple[str, ...]
  devices_per_host: int = 4
  microbatch: int = 16
  per_host_batch: int = 512
  fixed_s: float = 0.01
  noise: float = 0.03
  straggler_rate: float = 0.0005
  straggler_steps: int = 20
  straggler_slowdown: float = 2.5
  grad_bytes: float = 25.6e6 * 4
  bandwidth: float = 25e9
  latency_s: float = 10e-6

  @property
  def num_hosts(self) -> int:
    return len(self.gpus)

  @property
  def global_batch(self) -> int:
    return self.per_host_batch * self.num_hosts

  @property
  def granularity(self) -> np.ndarray:
    return np.full(self.num_hosts, self.microbatch * self.devices_per_host, np.int64)

  def costs(self) -> balancer_lib.CostParams:
    """The true (noise-free) cost of every host, in the balancer's own model."""
    speed = np.array([GPU_SPEED[g] for g in self.gpus]) * A100_SAMPLES_PER_S * self.devices_per_host
    return balancer_lib.CostParams(np.full(self.num_hosts, self.fixed_s), 1.0 / speed,
                                   self.granularity)

  def comm_s(self) -> float:
    return ring_allreduce_s(self.num_hosts, self.grad_bytes, self.bandwidth, self.latency_s)


def slowdowns(spec: ClusterSpec, steps: int, seed: int = 0) -> np.ndarray:
  """`[steps, hosts]` compute-time factors: log-normal noise times slow spells."""
  rng = np.random.default_rng(seed)
  factors = np.exp(spec.noise * rng.standard_normal((steps, spec.num_hosts)))
  starts = rng.random((steps, spec.num_hosts)) < spec.straggler_rate
  left = np.zeros(spec.num_hosts, np.int64)
  for s in range(steps):
    left = np.where(starts[s] & (left == 0), spec.straggler_steps, left)
    factors[s] *= np.where(left > 0, spec.straggler_slowdown, 1.0)
    left = np.maximum(left - 1, 0)
  return factors


def make(mode: str, spec: ClusterSpec, **options: Any) -> balancer_lib.Balancer:
  """The balancer for `mode` ('equal', 'static', 'dynamic') on `spec`'s cluster."""
  return balancer_lib.make_balancer("equal", spec.global_batch, spec.num_hosts, mode=mode,
                                    granularity=spec.granularity.tolist(), **options)


@dataclasses.dataclass
class SimResult:
  """What a simulated run measured (simulated seconds)."""

  mode: str
  num_hosts: int
  samples_per_s: float
  step_s: np.ndarray
  shares: list[tuple[int, ...]]
  decisions: list[dict[str, Any]]


def simulate(spec: ClusterSpec, bal: balancer_lib.Balancer, steps: int = 60, *,
             measure_from: int = 10, seed: int = 0,
             factors: np.ndarray | None = None) -> SimResult:
  """Runs `steps` synchronous steps; throughput counts steps from `measure_from`.

  The same `seed` gives the same noise and stragglers to every mode, so modes
  are compared on identical conditions.
  """
  if not 0 <= measure_from < steps:
    raise ValueError(f"measure_from ({measure_from}) must be in [0, steps={steps}).")
  true = spec.costs()
  factors = slowdowns(spec, steps, seed) if factors is None else factors
  comm = spec.comm_s()
  clock, step_s, seen = 0.0, np.zeros(steps), []
  for step in range(steps):
    shares = bal.shares(step)
    compute = true.predict(shares) * factors[step]
    finish = clock + compute  # One event per host: its local program ends.
    barrier = float(finish.max())  # The collective starts when the last host arrives.
    end = barrier + comm
    step_s[step], clock = end - clock, end
    seen.append(tuple(shares))
    bal.observe(step, shares, compute.tolist())  # The timing vector rides the collective.
  rate = spec.global_batch * (steps - measure_from) / float(step_s[measure_from:].sum())
  return SimResult(bal.name, spec.num_hosts, rate, step_s, seen,
                   list(getattr(bal, "decisions", [])))


def single_host_samples_per_s(spec: ClusterSpec, gpu: str) -> float:
  """Noise-free throughput of one host of class `gpu` alone (no collective)."""
  one = dataclasses.replace(spec, gpus=(gpu,))
  return one.per_host_batch / float(one.costs().predict([one.per_host_batch])[0])
