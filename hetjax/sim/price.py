"""What a micro-batch size costs on each GPU class: the simulator's price of small kernels.

Pure numpy, SIMULATED: a GPU runs small micro-batches far below its peak, and
each one is another program run. Sources in `ASSUMPTIONS`:

- per-device throughput at micro-batch `s`: `peak * s / (s + HALF_BATCH)`,
  fitted (relative least squares) to NVIDIA Deep Learning Examples' MXNet
  ResNet-50 v1.5 inference tables, mixed precision, batch 1..256 (DGX A100
  80GB: 463..6198 img/s; DGX-1 V100 16GB: 286..3362 img/s), the only public
  per-batch figures for both; training runs the same layer shapes, so the
  shape is taken over at the simulator's training level (read at 256).
  H100: same shape assumed.
- per program run: a launch gap (assumed) plus the gradient accumulation
  (3 x the fp32 values over the memory bandwidth).
- memory: the largest micro-batch is 192 images per 16 GB (that README's
  V100 16GB training batch) times the fraction `auto` may use.
"""

from __future__ import annotations

import numpy as np

HALF_BATCH = 11.0  # Samples per device at half the peak (fit: A100 10.5, V100 11.1).
REFERENCE_BATCH = 256  # The training figures' per-GPU batch: the level is read there.
LAUNCH_S = 20e-6  # Assumed gap per program run on the device (launch, sync of the loop).
MEMORY_GB = {"H100": 80.0, "A100": 40.0, "V100": 16.0}  # Data sheets (A100: the 1,555 GB/s part).
SAMPLES_PER_16GB = 192  # DLE's mixed-precision ResNet-50 batch on a V100 16GB.
MEMORY_FRACTION = 0.8  # What `auto` may fill (`--device-batch-memory-fraction`'s default).

ASSUMPTIONS = (
    ("throughput vs micro-batch", f"peak x s / (s + {HALF_BATCH:g}) per device; level = the simulator's training throughput at s = {REFERENCE_BATCH}", "fit to NVIDIA DeepLearningExamples MXNet RN50 v1.5 README inference tables (A100 80GB, V100 16GB, mixed precision, batch 1-256); H100 shape assumed the same"),
    ("per program run", f"{LAUNCH_S * 1e6:g} us launch + gradient accumulation (3 x 4 B x 25.6 M / HBM bandwidth)", "launch assumed; HBM from data sheets"),
    ("largest micro-batch", f"{SAMPLES_PER_16GB} per 16 GB x memory (H100 80, A100 40, V100 16 GB) x {MEMORY_FRACTION:g}", "DLE's V100 16GB batch; data sheets"),
    ("auto device batch", "largest power of two k with k x m fitting memory, halved while k/2 is as fast per sample", "hetjax.step.device_batch's rule"),
)


def device_samples_per_s(gpu_samples_per_s: float, samples: float | np.ndarray) -> np.ndarray:
  """Per-device throughput at a micro-batch of `samples`, for a GPU whose throughput at
  `REFERENCE_BATCH` is `gpu_samples_per_s`."""
  peak = gpu_samples_per_s * (REFERENCE_BATCH + HALF_BATCH) / REFERENCE_BATCH
  s = np.asarray(samples, np.float64)
  return peak * s / (s + HALF_BATCH)


def program_s(gpu_samples_per_s: float, samples: float, hbm_bytes_per_s: float,
              accum_bytes: float) -> float:
  """Seconds of one program run: a micro-batch of `samples` on every device of a host."""
  compute = samples / float(device_samples_per_s(gpu_samples_per_s, samples))
  return compute + LAUNCH_S + accum_bytes / hbm_bytes_per_s


def max_microbatch(gpu: str, fraction: float = MEMORY_FRACTION) -> int:
  """The largest per-device micro-batch (samples) that fits `fraction` of the device's memory."""
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"memory fraction must be in (0, 1], got {fraction}.")
  return int(SAMPLES_PER_16GB / 0.8 * fraction * MEMORY_GB[gpu] / 16.0)


def auto_device_batch(gpu: str, microbatch: int, times: "callable",
                      fraction: float = MEMORY_FRACTION) -> int:
  """`auto`: the largest power-of-two `k` whose `k x microbatch` fits, halved while `k/2`
  is at least as fast per sample (`times(k)`: seconds of one program of `k` blocks)."""
  cap = max_microbatch(gpu, fraction) // int(microbatch)
  if cap < 1:
    raise ValueError(f"a micro-batch of {microbatch} does not fit a {gpu} at memory fraction "
                     f"{fraction}; lower --microbatch.")
  k = 1 << (cap.bit_length() - 1)
  while k > 1 and times(k // 2) / (k // 2) <= times(k) / k:
    k //= 2
  return k
