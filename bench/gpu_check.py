"""Every GPU claim hetjax makes, measured in one command on whatever GPU is lent.

On a GPU machine, from the repository root (no install step: the script puts
the repository on `sys.path` and imports only hetjax, JAX, Flax, optax,
orbax and numpy, which that machine's own Python has):

  python3 bench/gpu_check.py --out DIR [--budget S] [--sections ...] [--profile] [--plan]

On this CPU, with tiny sizes, so the script cannot rot between GPU visits
(tests/test_gpu_check.py runs it):

  .venv/bin/python bench/gpu_check.py --smoke --out DIR

It prints its plan (each section's estimated GPU seconds, compiles
included), then runs the sections below, most valuable first, that fit in
`--budget` seconds (default 360 on a GPU, none with `--smoke`; 0: none):
a section runs only whole, except the overhead section, whose rows (a model
in a precision) run as far as the budget goes. The clock keeps watch as
well: a row or section that no longer fits once the run has fallen behind
its plan is skipped. `DIR/gpu_check.json` is written (atomically) when each
section starts and ends and after every overhead row, so a run killed
halfway keeps what it finished; a later run with `--sections` replaces only
the sections it runs. A section that fails, or that the platform refuses,
is recorded with the exception's type and message, and the next one runs.
It ends with one table. `--plan` prints the plan and exits; `--profile`
adds a `jax.profiler` trace of a few steps of both loops per overhead row
(DIR/profile/MODEL-PRECISION), for whatever falls short.

Sections, most valuable first:
  overhead        hetjax's `Trainer.fit` against a plain `jax.jit` loop
                  (`bench/overhead.py`'s loops: same model, batch, adam,
                  dtype, input path), per model in fp32 and bf16: the
                  throughput ratio and the ms hetjax adds to a step.
  precision       bf16 against fp32, per model, from the overhead rows (no
                  GPU time of its own).
  two_hosts       two processes sharing the first GPU, each with its own
                  part of the memory (no preallocation), an uneven split,
                  a few steps of the sharded update, once per reduction
                  backend: `host` (the update on each host's CPU, beside
                  the GPU client) and `device` (NCCL's reduce-scatter and
                  all-gather, which NCCL refuses with two ranks on one GPU:
                  the refusal is recorded). Step ms per host, and whether
                  the two replicas hold the same bits. The host pair then
                  runs hybrid and elastic rounds (their outer update on
                  the CPUs too): ms a round, whether the centres agree.
  checkpoint      the save call's share of a step, asynchronous (the
                  pinned-host snapshot) against synchronous
                  (`bench/checkpoint.py`).
  device_batches  one block per device against eight at once
                  (`TrainConfig(device_batch=k)`): `Trainer.fit` samples/s,
                  timed interleaved, as ratios over k = 1; then what
                  `--device-batch auto` picks on this device
                  (`hetjax.step.device_batch.choose`), with the memory it
                  read and the per-block times it compared.
  exactness       1 process x 1 device (this one) against the two_hosts
                  pair (2 x 1, rerun here if two_hosts did not run):
                  the same parameters up to float reduction order.
  within_host     (only when named) bench/memory.py's layer structures (nn.scan + nn.remat,
                  a Python loop, a jitted loss, NNX) compiled for 1 host
                  x 4 GPUs on JAX's mocked topology (`jax_mock_gpu_topology`
                  1x1x4) on this one GPU: a device's step peak with and
                  without `--shard-within-host`, from the GPU compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

_BENCH = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_BENCH)
for _path in (_ROOT, _BENCH):  # hetjax from the source tree; bench/overhead.py and friends.
  if _path not in sys.path:
    sys.path.insert(0, _path)

import numpy as np  # noqa: E402  (JAX is imported only once the environment is set)

# Most valuable first: the order they run in, and the order the budget serves them.
SECTIONS = ("overhead", "precision", "two_hosts", "checkpoint", "device_batches", "exactness")
# Run only when named (--sections within_host): bench/memory.py's layer structures on one
# GPU shown as 1 host x 4 GPUs (JAX's mocked topology: the GPU compiler's peaks, no real
# link), in a child process.
OPTIONAL = ("within_host",)
MOCK_TOPOLOGY, WITHIN_HOST_TIMEOUT_S = "1x1x4", 300
PRECISIONS = ("fp32", "bf16")
BACKENDS = ("host", "device")  # two_hosts runs the one every GPU pair can run first.
RESULT_FILE = "gpu_check.json"
GPU_BUDGET_S = 360  # A GPU lent for minutes: the whole check in 6, compiles included.
PROFILE_STEPS = 5  # Per loop, traced with `--profile` after the timed runs.
TARGET_RATIO = 0.97  # For resnet18 and resnet50.
TARGET_RATIO_MODELS = ("resnet18", "resnet50")
TARGET_ADDED_MS = 1.0  # For every model.
TWO_HOSTS_RTOL, TWO_HOSTS_ATOL = 1e-5, 1e-6
# The test suite's cheap XLA:CPU passes (tests/conftest.py): the smoke run's
# programs run a few steps on tiny inputs.
_CHEAP_PASSES = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_parallel_codegen_split_count=1")
MAIN_MEMORY_FRACTION = "0.5"  # Leaves room for the two_hosts processes beside this one.
HOST_MEMORY_FRACTION = "0.2"  # Each two_hosts process: its part, grown as needed.
# Words in an error that say the platform, not hetjax, refused (NCCL's two
# ranks on one GPU; a process's memory part too small).
REFUSALS = ("Duplicate GPU", "ncclInvalidUsage", "NCCL", "RESOURCE_EXHAUSTED", "out of memory",
            "UNIMPLEMENTED")
PAIR_TIMEOUT_MIN_S = 60  # A pair that NCCL leaves hanging is stopped, then recorded.
# The host pair also runs each rounds mode: ROUNDS timed rounds of these local steps per host.
ROUNDS_MODES = ("hybrid", "elastic")
ROUNDS, ROUNDS_LOCAL_STEPS = 3, (2, 1)


@dataclasses.dataclass(frozen=True)
class Size:
  """One model at one size: its data, batch and timed steps.

  `shape` is an image's (H, W, C) of uint8 pixels, or for the transformer
  `(sequence length,)`; `classes` is the number of labels or the vocabulary.
  """

  model: str
  shape: tuple[int, ...]
  classes: int
  global_batch: int
  steps: int
  overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
  compile_s: float = 0.0  # Estimated GPU seconds to compile one training program.
  step_ms: float = 0.0  # Estimated GPU ms of one fp32 step (bf16: about 0.6 of it).


@dataclasses.dataclass(frozen=True)
class TwoHosts:
  """The two-host check: a size, its block size and the uneven split."""

  size: Size
  microbatch: int
  shares: tuple[int, int]
  warmup: int = 2

  @classmethod
  def from_spec(cls, spec: dict[str, Any]) -> "TwoHosts":
    """The check back from `dataclasses.asdict` (as a pair's hosts receive it)."""
    size = Size(**{**spec["size"], "shape": tuple(spec["size"]["shape"])})
    return cls(size, spec["microbatch"], tuple(spec["shares"]), spec["warmup"])


@dataclasses.dataclass(frozen=True)
class DeviceBatches:
  """The device-batch check: a size, its block size and the device batches timed."""

  size: Size
  microbatch: int
  ks: tuple[int, ...] = (1, 8)


@dataclasses.dataclass(frozen=True)
class Profile:
  """Every size the sections use, for a GPU or for the CPU smoke run."""

  name: str
  models: dict[str, Size]
  repeats: int
  two_hosts: TwoHosts
  checkpoint: Size
  checkpoint_every: int
  device_batches: DeviceBatches
  startup_s: float  # Estimated: imports, backend start-up, the first transfers.
  process_s: float  # Estimated: one more process joining (imports, backend, cluster).
  # Overhead rows in this order, fp32 first: a budget cuts the last ones.
  default_models: tuple[str, ...] = ("resnet50", "resnet18", "mlp")


_IMAGENET = (224, 224, 3)
_CIFAR = (32, 32, 3)
_GPU_MODELS = {
    "mlp": Size("mlp", _CIFAR, 10, 1024, 100, {"hidden": (1024, 1024)}, 3, 1.0),
    "cnn": Size("cnn", _CIFAR, 10, 512, 50, {"features": (32, 64), "hidden": 256}, 4, 2.0),
    "resnet18": Size("resnet18", _IMAGENET, 1000, 128, 20, {}, 12, 20.0),
    "resnet50": Size("resnet50", _IMAGENET, 1000, 64, 10, {}, 25, 30.0),
    "transformer": Size("transformer", (256,), 1024, 64, 20,
                        {"d_model": 512, "num_layers": 6, "num_heads": 8, "max_len": 256}, 10, 10.0),
}
# The default models fit the budget with every other section (`--plan`): the
# two resnets the ratio target names, and the mlp, whose step is mostly
# hetjax's own overhead. `--models` adds the transformer and the cnn.
GPU = Profile(
    "gpu", _GPU_MODELS, repeats=7,
    # Compiles in 3 s: on an H200 both pairs took 21.7 s, the refused one stopping early.
    two_hosts=TwoHosts(Size("resnet18", _CIFAR, 10, 128, 6,
                            {"width": 8, "stage_sizes": (1, 1, 1, 1)}, 3, 5.0),
                       microbatch=32, shares=(32, 96)),
    # The overhead section's resnet50: its programs come from the compilation cache.
    # Saves 24 steps apart (0.9 s on an H200) leave orbax's hand-over (0.7 s
    # there) time to finish: the save call then shows its own block, not a
    # wait for the previous save.
    checkpoint=dataclasses.replace(_GPU_MODELS["resnet50"], steps=72), checkpoint_every=24,
    # 8 blocks of 8 images: k = 8 runs the batch as one program, k = 1 as eight.
    device_batches=DeviceBatches(dataclasses.replace(_GPU_MODELS["resnet18"], global_batch=64,
                                                     steps=10, step_ms=12.0), microbatch=8),
    startup_s=20, process_s=10)

_TINY = (8, 8, 1)
_SMOKE_MODELS = {
    "mlp": Size("mlp", _TINY, 10, 32, 3, {"hidden": (16,)}, 1, 1.0),
    "cnn": Size("cnn", _TINY, 10, 16, 2, {"features": (4, 4), "hidden": 8}, 2, 1.0),
    "resnet18": Size("resnet18", _TINY, 10, 8, 2, {"width": 2, "stage_sizes": (1, 1, 1, 1)}, 6,
                     5.0),
    "resnet50": Size("resnet50", _TINY, 10, 8, 2, {"width": 2, "stage_sizes": (1, 1, 1, 1)}, 8,
                     5.0),
    "transformer": Size("transformer", (8,), 16, 8, 2,
                        {"d_model": 8, "num_layers": 1, "num_heads": 2, "max_len": 8}, 2, 2.0),
}
# The mlp's overhead rows and the transformer's checkpoint run cover every
# path of the script (images and tokens); each more model costs the CPU
# seconds of its compiles, nothing else. Estimates in seconds of this 2-core CPU.
SMOKE = Profile(
    "smoke", _SMOKE_MODELS, repeats=2,
    two_hosts=TwoHosts(Size("mlp", _TINY, 10, 32, 3, {"hidden": (16,), "dropout": 0.1}, 1, 2.0),
                       microbatch=8, shares=(8, 24)),
    checkpoint=dataclasses.replace(_SMOKE_MODELS["transformer"], steps=4), checkpoint_every=2,
    device_batches=DeviceBatches(_SMOKE_MODELS["mlp"], microbatch=4, ks=(1, 4)),
    startup_s=3, process_s=4, default_models=("mlp",))


# ---- Data and models ---------------------------------------------------------


def make_source(size: Size):
  """Random uint8 images (or tokens) in memory: two global batches' worth of records.

  uint8 pixels are what an image pipeline hands the device (hetjax scales them
  on the device, `hetjax.models.preprocess`); both loops gather and transfer
  them every step.
  """
  import hetjax
  rng = np.random.default_rng(0)
  n = 2 * size.global_batch
  if size.model == "transformer":
    x = rng.integers(0, size.classes, (n, *size.shape), dtype=np.int32)
    return hetjax.ArraySource({"x": x}, hetjax.DatasetInfo("tokens", "tokens",
                                                           vocab_size=size.classes))
  x = rng.integers(0, 256, (n, *size.shape), dtype=np.uint8)
  y = rng.integers(0, size.classes, n, dtype=np.int32)
  return hetjax.ArraySource({"x": x, "y": y},
                            hetjax.DatasetInfo("images", "image", num_classes=size.classes))


def make_task(size: Size, source):
  from hetjax import models as zoo
  return zoo.build(size.model, kind=source.info.kind, num_classes=source.info.num_classes,
                   vocab_size=source.info.vocab_size, **size.overrides)


# ---- Sections ----------------------------------------------------------------


@dataclasses.dataclass
class Context:
  profile: Profile
  models: list[str]
  results: dict[str, Any]
  save: Callable[[], None]  # Writes the JSON as it stands.
  profile_dir: str | None = None  # Where `--profile` writes jax.profiler traces.
  section: dict[str, Any] = dataclasses.field(default_factory=dict)  # The one running.
  planned: set[str] = dataclasses.field(default_factory=set)  # Rows and sections the budget holds.
  end: float = math.inf  # perf_counter() at the end of the budget.
  until: float = math.inf  # perf_counter() after which the running section starts no more rows.
  # two_hosts' pairs by backend, each host's result; None: tried, and it did not run.
  pairs: dict[str, list[dict[str, Any]] | None] = dataclasses.field(default_factory=dict)

  def fits(self, seconds: float) -> bool:
    """Whether work of `seconds` (estimated) still fits before `until`."""
    return time.perf_counter() + seconds <= self.until


def overhead_section(ctx: Context) -> dict[str, Any]:
  """Plain jit loop against `Trainer.fit`, per model and precision; saved after each.

  A row outside the budget's plan, or that no longer fits the clock, is
  marked skipped. A model that fails is recorded and the next one runs: a
  short GPU window should not lose the other rows to one error.
  """
  rows = ctx.section.setdefault("rows", {})
  estimates = overhead_rows(ctx.profile, ctx.models)
  for key, seconds in estimates.items():
    name, precision = key.split("/")
    planned = f"overhead:{key}" in ctx.planned
    if not planned or not ctx.fits(seconds):
      why = ("not in the plan for the budget (--budget)" if not planned else
             "the run fell behind its plan: it no longer fit (--budget)")
      rows[key] = {"model": name, "precision": precision, "skipped": why}
      continue
    try:
      rows[key] = _overhead_row(ctx.profile.models[name], precision, ctx.profile.repeats,
                                ctx.profile_dir)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the next model runs)
      traceback.print_exc()
      rows[key] = {"model": name, "precision": precision, "error": describe_error(e)}
    ctx.save()
  failed = sorted(k for k, r in rows.items() if "error" in r)
  skipped = sorted(k for k, r in rows.items() if "skipped" in r)
  status = ({"status": "failed", "error": f"rows failed: {failed}"} if failed else
            {"status": "partial", "why": f"rows skipped for the budget: {skipped}"}
            if skipped else {})
  return {"rows": rows, "targets": {"ratio": TARGET_RATIO, "ratio_models": TARGET_RATIO_MODELS,
                                    "added_ms": TARGET_ADDED_MS}, **status}


def describe_error(e: BaseException, limit: int = 3000) -> str:
  """The exception's type and message; a long one (a host's traceback) keeps its end."""
  text = f"{type(e).__name__}: {e}"
  return text if len(text) <= limit else text[:500] + " ... " + text[-(limit - 505):]


def _overhead_row(size: Size, precision: str, repeats: int,
                  profile_dir: str | None) -> dict[str, Any]:
  """One model in one precision: both loops built, timed interleaved, closed."""
  import overhead as bench_overhead
  source = make_source(size)
  loops = bench_overhead.make_loops(make_task(size, source), source, size.global_batch,
                                    size.global_batch, precision, ("plain", "hetjax"))
  try:
    ms = bench_overhead.time_loops(loops, size.steps, repeats)
    if profile_dir:
      trace(loops, os.path.join(profile_dir, f"{size.model}-{precision}"))
  finally:
    loops["hetjax"].trainer.close()
    del loops
    gc.collect()  # The next model's buffers need this one's device memory.
  name = size.model
  row = {"model": name, "precision": precision, "global_batch": size.global_batch,
         "input": list(size.shape), "steps": size.steps, "repeats": repeats,
         "plain_ms": round(float(np.median(ms["plain"])), 3),
         "hetjax_ms": round(float(np.median(ms["hetjax"])), 3),
         **bench_overhead.paired(ms, "plain", "hetjax")}
  row["meets_target"] = bool(row["added_ms"] <= TARGET_ADDED_MS and (
      name not in TARGET_RATIO_MODELS or row["ratio"] >= TARGET_RATIO))
  print(f"  {name:>11} {precision}: plain {row['plain_ms']:.2f} ms, hetjax "
        f"{row['hetjax_ms']:.2f} ms, ratio {row['ratio']:.3f}, added {row['added_ms']:.2f} ms",
        flush=True)
  return row


def trace(loops: dict[str, Any], directory: str, steps: int = PROFILE_STEPS) -> None:
  """A jax.profiler trace of a few steps of each loop, one after the other.

  Where hetjax adds time on a device, this shows which program or which
  host gap it is (open `directory` with xprof / TensorBoard's profile tab).
  """
  import jax
  with jax.profiler.trace(directory):
    for label, loop in loops.items():
      with jax.profiler.TraceAnnotation(f"gpu_check {label}"):
        loop.run(steps)
        loop.wait()


def two_hosts_entry(spec: dict[str, Any], reduction: str) -> dict[str, Any]:
  """One host of a two_hosts pair (a `hetjax.testing.run_hosts` entry); under the host
  reduction the rounds modes too, which then need no device collective either."""
  import hetjax
  hetjax.initialize()
  result = train_check(spec, reduction)
  if reduction == "host":
    result["modes"] = {mode: rounds_check(spec, mode) for mode in ROUNDS_MODES}
  return result


def rounds_check(spec: dict[str, Any], mode: str) -> dict[str, Any]:
  """A few rounds of `mode` on the pair under the host reduction: ms a round, the centre."""
  import jax
  import optax
  import hetjax
  check = TwoHosts.from_spec(spec)
  size = check.size
  source = make_source(size)
  config = hetjax.TrainConfig(global_batch=size.global_batch, microbatch=check.microbatch,
                              seed=0, reduction="host")
  strategy = {"hybrid": hetjax.Hybrid, "elastic": hetjax.Elastic}[mode](
      local_steps=ROUNDS_LOCAL_STEPS)
  with jax.default_matmul_precision("highest"):
    trainer = hetjax.Trainer(make_task(size, source), optax.sgd(0.02), source, config,
                             mode=strategy)
    try:
      trainer.fit(check.warmup)  # A round ends with nothing in flight: no wait needed.
      t0 = time.perf_counter()
      trainer.fit(ROUNDS)
      round_ms = (time.perf_counter() - t0) / ROUNDS * 1e3
      centre = [np.asarray(p) for p in jax.tree.leaves(trainer.params())]
    finally:
      trainer.close()
  return {"round_ms": round(round_ms, 3), "centre": centre}


def train_check(spec: dict[str, Any], reduction: str) -> dict[str, Any]:
  """The two-host check's run on whatever cluster this process joined: the pair's
  uneven split, or the whole batch on one process (the exactness reference).

  Matmuls at full float32 precision, so the comparison is about hetjax's
  math, not about which TF32 kernel each process's autotuner picked.
  """
  import jax
  import optax
  import hetjax
  check = TwoHosts.from_spec(spec)
  size, hosts = check.size, jax.process_count()
  source = make_source(size)
  config = hetjax.TrainConfig(
      global_batch=size.global_batch, microbatch=check.microbatch, seed=0,
      assignment=check.shares if hosts > 1 else "equal", reduction=reduction)
  with jax.default_matmul_precision("highest"):
    trainer = hetjax.Trainer(make_task(size, source), optax.sgd(0.02), source, config)
    try:
      trainer.fit(check.warmup)
      trainer.mode.block_until_ready()
      t0 = time.perf_counter()
      trainer.fit(size.steps)
      trainer.mode.block_until_ready()
      step_ms = (time.perf_counter() - t0) / size.steps * 1e3
      params = [np.asarray(p) for p in jax.tree.leaves(trainer.params())]
      memory = trainer.mode.memory_per_device()
    finally:
      trainer.close()
  return {"host": jax.process_index(), "hosts": hosts, "step_ms": round(step_ms, 3),
          "share": check.shares[jax.process_index()] if hosts > 1 else size.global_batch,
          "device": str(jax.local_devices()[0].device_kind), "params": params,
          "split_over": memory["split_over"], "updated_on": memory["where"]}


def _max_differences(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float, bool]:
  """(max |got - want|, max |got - want| / |want| where want != 0, allclose)."""
  abs_diff = max(float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(got, want))
  rel = max(float(np.max(np.abs(a - b)[b != 0] / np.abs(b[b != 0]), initial=0.0))
            for a, b in zip(got, want))
  close = all(np.allclose(a, b, rtol=TWO_HOSTS_RTOL, atol=TWO_HOSTS_ATOL)
              for a, b in zip(got, want))
  return abs_diff, rel, close


def pair_seconds(profile: Profile, reduction: str = "device") -> float:
  """Estimated seconds of one two_hosts pair: both processes start and compile side by
  side; the host pair then runs the rounds modes (a local step and an outer update each)."""
  s = profile.two_hosts.size
  sync = profile.process_s + 2 * s.compile_s + 2 * (profile.two_hosts.warmup + s.steps) * (
      s.step_ms / 1e3)
  rounds = len(ROUNDS_MODES) * (2 * s.compile_s + (profile.two_hosts.warmup + ROUNDS) * sum(
      ROUNDS_LOCAL_STEPS) * s.step_ms / 1e3)
  return sync + (rounds if reduction == "host" else 0.0)


def run_pair(ctx: Context, reduction: str) -> list[dict[str, Any]]:
  """Two processes sharing the first GPU, each with its part of the memory, allocated as
  needed (no preallocation of the device); `reduction` their backend. Each host's result.

  Stopped past a few times its estimate (or the budget's end): a pair that
  the platform leaves hanging costs minutes, not the hour.
  """
  from hetjax.testing import run_hosts
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
         "XLA_PYTHON_CLIENT_MEM_FRACTION": HOST_MEMORY_FRACTION,
         # Both processes on the same (first) GPU, whatever the machine has.
         "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
  entry = f"{__name__ if __name__ != '__main__' else 'gpu_check'}:two_hosts_entry"
  timeout = max(PAIR_TIMEOUT_MIN_S, 3 * pair_seconds(ctx.profile, reduction))
  timeout = min(timeout, max(PAIR_TIMEOUT_MIN_S / 2, ctx.end - time.perf_counter()))
  return run_hosts(entry, hosts=2, args=(dataclasses.asdict(ctx.profile.two_hosts), reduction),
                   env=env, timeout_s=timeout, quiet=True)  # A refusal is one line (`headline`).


def headline(text: str, limit: int = 300) -> str:
  """One line of an error for the table: the last that names a refusal, else its last line.

  The table is often all a GPU visit brings back (the tail of its output):
  two hosts' tracebacks would fill it; gpu_check.json keeps the whole text.
  """
  lines = [line.strip() for line in text.splitlines() if line.strip()] or [""]
  named = [line for line in lines if any(word in line for word in REFUSALS)]
  line = (named or lines)[-1]
  return line if len(line) <= limit else line[:limit - 3] + "..."


def refusal(e: BaseException) -> dict[str, Any]:
  """A pair that did not run: 'refused' when the error names the platform (NCCL, memory)."""
  text = describe_error(e)
  refused = any(word in text for word in REFUSALS)
  return {"status": "refused" if refused else "failed", "error": text}


def two_hosts_section(ctx: Context) -> dict[str, Any]:
  """A pair of processes sharing one device per reduction backend: step ms, replicas' bits.

  With two processes on one GPU, NCCL refuses the device backend ("Duplicate
  GPU detected"): recorded as refused, and the host backend, which crosses
  hosts only over the CPUs, still runs.
  """
  check = ctx.profile.two_hosts
  backends = {}
  out = {"model": check.size.model, "overrides": check.size.overrides,
         "global_batch": check.size.global_batch, "microbatch": check.microbatch,
         "shares": list(check.shares), "steps": check.warmup + check.size.steps,
         "memory": {"fraction": float(HOST_MEMORY_FRACTION), "preallocate": False},
         "backends": backends}
  for reduction in BACKENDS:
    if not ctx.fits(pair_seconds(ctx.profile, reduction)):
      backends[reduction] = {"status": "skipped", "why": "the run fell behind its plan: it no "
                             "longer fit (--budget)"}
      continue
    try:
      pair = run_pair(ctx, reduction)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the next backend runs)
      backends[reduction], ctx.pairs[reduction] = refusal(e), None
      if backends[reduction]["status"] == "failed":  # A refusal is expected: its line will do.
        traceback.print_exc()
    else:
      ctx.pairs[reduction] = pair
      backends[reduction] = {
          "status": "ok", "device": pair[0]["device"], "split_over": pair[0]["split_over"],
          "updated_on": pair[0]["updated_on"],
          "step_ms": {f"host{r['host']}": r["step_ms"] for r in pair},
          "replicas_equal": all(np.array_equal(a, b)
                                for a, b in zip(pair[0]["params"], pair[1]["params"]))}
      if "modes" in pair[0]:  # The rounds modes: their outer update on the hosts' CPUs.
        backends[reduction]["modes"] = {
            mode: {"round_ms": {f"host{r['host']}": r["modes"][mode]["round_ms"] for r in pair},
                   "local_steps": list(ROUNDS_LOCAL_STEPS),
                   "centres_equal": all(np.array_equal(a, b) for a, b in zip(
                       pair[0]["modes"][mode]["centre"], pair[1]["modes"][mode]["centre"]))}
            for mode in pair[0]["modes"]}
    ctx.section.update(out)
    ctx.save()
  statuses = {b["status"] for b in backends.values()}
  if "failed" in statuses:
    out.update(status="failed", error="; ".join(f"{k}: {b['error']}" for k, b in backends.items()
                                                if b["status"] == "failed"))
  elif statuses != {"ok"}:
    out.update(status="partial", why="; ".join(
        f"the {k} backend's pair {b['status']}" for k, b in backends.items()
        if b["status"] != "ok"))
  return out


def exactness_section(ctx: Context) -> dict[str, Any]:
  """1 process x 1 device (this process) against the 2 x 1 pairs: the same parameters
  up to float reduction order (rtol `TWO_HOSTS_RTOL`).

  The pairs are two_hosts' when it ran in this process; else the host
  backend's pair runs here. When two_hosts' host pair did not run, neither
  does this section: the same pair would meet the same refusal.
  """
  check = ctx.profile.two_hosts
  if ctx.pairs.get("host", ()) is None:
    return {"status": "skipped", "why": "two_hosts' host pair did not run (see two_hosts)"}
  pairs, ran_here = {k: v for k, v in ctx.pairs.items() if v is not None}, False
  if "host" not in pairs:
    pairs["host"], ran_here = run_pair(ctx, "host"), True
  reference = train_check(dataclasses.asdict(check), "device")
  against = {}
  for reduction, pair in pairs.items():
    abs_diff, rel_diff, close = _max_differences(pair[0]["params"], reference["params"])
    against[reduction] = {"params_equal": bool(close), "max_abs_diff": abs_diff,
                          "max_rel_diff": rel_diff}
  return {"model": check.size.model, "global_batch": check.size.global_batch,
          "microbatch": check.microbatch, "shares": list(check.shares),
          "steps": check.warmup + check.size.steps, "device": reference["device"],
          "rtol": TWO_HOSTS_RTOL, "atol": TWO_HOSTS_ATOL,
          "pairs_from": "this section" if ran_here else "two_hosts",
          "one_process_step_ms": reference["step_ms"], "against": against}


def checkpoint_section(ctx: Context) -> dict[str, Any]:
  """`bench/checkpoint.py`'s measurement on one model, async then sync."""
  import optax
  import hetjax
  import checkpoint as bench_checkpoint
  import overhead as bench_overhead
  size = ctx.profile.checkpoint
  source = make_source(size)
  task = make_task(size, source)
  # The overhead section's hetjax configuration: the same programs, so the
  # compilation cache and the autotuner's results carry over.
  config = hetjax.TrainConfig(global_batch=size.global_batch, microbatch=size.global_batch,
                              seed=bench_overhead.SEED)

  def build(directory: str, async_save: bool) -> hetjax.Trainer:
    return hetjax.Trainer(task, optax.adam(bench_overhead.LEARNING_RATE), source, config,
                          checkpoint=bench_checkpoint.saving_every_call(directory, async_save))

  out = {"model": size.model, "global_batch": size.global_batch, "input": list(size.shape),
         "steps": size.steps, "every": ctx.profile.checkpoint_every}
  for mode in ("async", "sync"):
    r = bench_checkpoint.measure(build, mode == "async", size.steps, ctx.profile.checkpoint_every)
    out[mode] = {k: round(v, 6) if isinstance(v, float) else v for k, v in r.items()}
    ctx.section.update(out)
    ctx.save()
  out["async_over_sync_stall"] = round(out["async"]["stall_s"] / max(out["sync"]["stall_s"], 1e-9), 4)
  return out


def device_batches_section(ctx: Context) -> dict[str, Any]:
  """samples/s per device batch k (interleaved repeats, ratios over k = 1), then `auto`'s pick."""
  import jax
  import optax
  import hetjax
  from hetjax.step import device_batch as device_batch_lib
  check = ctx.profile.device_batches
  size = check.size
  source = make_source(size)
  task = make_task(size, source)
  trainers = {}
  for k in check.ks:
    config = hetjax.TrainConfig(global_batch=size.global_batch, microbatch=check.microbatch,
                                device_batch=k, check_every=0)
    trainers[k] = hetjax.Trainer(task, optax.adam(1e-3), source, config)
    trainers[k].fit(2)  # Compiles every program of its ladder.
    trainers[k].mode.block_until_ready()
  samples_s: dict[int, list[float]] = {k: [] for k in check.ks}
  try:
    for _ in range(ctx.profile.repeats):
      for k, tr in trainers.items():
        t0 = time.perf_counter()
        tr.fit(size.steps)
        tr.mode.block_until_ready()
        samples_s[k].append(size.global_batch * size.steps / (time.perf_counter() - t0))
    tr = trainers[check.ks[0]]
    state = tr.state
    device = jax.local_devices()[0]
    blocks = -(-size.global_batch // check.microbatch)
    choice = device_batch_lib.choose(task, state.params, state.model_state,
                                     source[np.arange(1)], check.microbatch, device=device,
                                     cap=blocks)
  finally:
    for tr in trainers.values():
      tr.close()
    del trainers
    gc.collect()
  base = samples_s[check.ks[0]]
  rows = {str(k): {"samples_s": round(float(np.median(v)), 2),
                   "over_k1": round(float(np.median(np.array(v) / np.array(base))), 4)}
          for k, v in samples_s.items()}
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return {"model": size.model, "global_batch": size.global_batch, "input": list(size.shape),
          "microbatch": check.microbatch, "steps": size.steps, "repeats": ctx.profile.repeats,
          "rows": rows,
          "auto": {"k": choice.k, "memory_k": choice.memory_k,
                   "ms_per_block": {str(j): round(v * 1e3, 4)
                                    for j, v in choice.seconds_per_block.items()},
                   "bytes_limit": None if not stats else stats.get("bytes_limit"),
                   "bytes_in_use": None if not stats else stats.get("bytes_in_use"),
                   "says": choice.describe()}}


def precision_section(ctx: Context) -> dict[str, Any]:
  """bf16 over fp32 step time, per model, from the overhead rows (this run's or the last)."""
  rows = ctx.results["sections"].get("overhead", {}).get("rows", {})
  speedups = {}
  for name in ctx.models:
    fp32, bf16 = rows.get(f"{name}/fp32"), rows.get(f"{name}/bf16")
    if fp32 and bf16 and "hetjax_ms" in fp32 and "hetjax_ms" in bf16:
      speedups[name] = {"hetjax": round(fp32["hetjax_ms"] / bf16["hetjax_ms"], 4),
                        "plain": round(fp32["plain_ms"] / bf16["plain_ms"], 4)}
  if not speedups:
    return {"status": "skipped", "why": "no overhead rows in both precisions: run it with "
            "`--sections overhead,precision`."}
  return {"speedup": speedups}


def within_host_section(ctx: Context) -> dict[str, Any]:
  """A device's step peak with and without sharding within a host, per layer structure, from
  the GPU compiler's memory analysis of a 1 x 4 step on a mocked 4-GPU topology."""
  import subprocess
  command = [sys.executable, os.path.join(os.path.dirname(__file__), "memory.py"),
             "--parts", "structures", "--devices", "4"]
  env = {**os.environ, "JAX_MOCK_GPU_TOPOLOGY": MOCK_TOPOLOGY}
  env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
  run = subprocess.run(command, env=env, capture_output=True, text=True,
                       timeout=min(WITHIN_HOST_TIMEOUT_S, max(30.0, ctx.end - time.perf_counter())))
  rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
  out = {"command": f"JAX_MOCK_GPU_TOPOLOGY={MOCK_TOPOLOGY} " + " ".join(command[1:]),
         "rows": {r["structure"]: {k: r[k] for k in ("device_batch", "step_peak_off",
                                                      "step_peak_on", "ratio")} for r in rows}}
  if run.returncode != 0:
    out.update(status="failed", error=headline(run.stderr), stderr_tail=run.stderr[-3000:])
  return out


RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "overhead": overhead_section, "precision": precision_section,
    "two_hosts": two_hosts_section, "checkpoint": checkpoint_section,
    "device_batches": device_batches_section, "exactness": exactness_section,
    "within_host": within_host_section}


# ---- The plan ----------------------------------------------------------------


def _steps_s(size: Size, steps: int, precision: str = "fp32") -> float:
  return steps * size.step_ms * (0.6 if precision == "bf16" else 1.0) / 1e3


def overhead_rows(profile: Profile, models: list[str]) -> dict[str, float]:
  """Estimated seconds of each overhead row ('MODEL/PRECISION'), in the order they run.

  hetjax compiles two training programs per configuration (the first step's,
  and the later steps' with the previous update inside); the plain loop one.
  The autotuner keeps its results per process, so programs after a model's
  first compile for about half their time.
  """
  return {f"{m}/{p}": s.compile_s * 2.0 + 2 * _steps_s(s, 5 + s.steps * profile.repeats, p)
          for p in PRECISIONS for m, s in ((m, profile.models[m]) for m in models)}


def plan(profile: Profile, sections: list[str], models: list[str]) -> dict[str, float]:
  """Estimated seconds per section, compiles included (`Size.compile_s`, `step_ms`)."""
  est: dict[str, float] = {}
  if "overhead" in sections:
    est["overhead"] = sum(overhead_rows(profile, models).values())
  if "precision" in sections:
    est["precision"] = 0.0
  if "two_hosts" in sections:
    est["two_hosts"] = sum(pair_seconds(profile, reduction) for reduction in BACKENDS)
  if "checkpoint" in sections:
    s = profile.checkpoint
    saves = 2 * (s.steps // profile.checkpoint_every + 1)  # About a second each (~300 MB).
    # After the overhead rows of its model, its programs come from the compilation cache.
    compiles = 0.4 if "overhead" in sections and s.model in models else 2.0
    est["checkpoint"] = compiles * s.compile_s + 2 * _steps_s(s, s.steps + 4) + saves
  if "device_batches" in sections:
    check = profile.device_batches
    s = check.size
    # The largest k's ladder holds every smaller k's programs (two per size;
    # the others come from the compilation cache); then auto's three.
    programs = 2 * (int(math.log2(max(check.ks))) + 1) + 3
    est["device_batches"] = 0.5 * programs * s.compile_s + len(check.ks) * _steps_s(
        s, 2 + s.steps * profile.repeats)
  if "exactness" in sections:
    s = profile.two_hosts.size  # The reference here; the pair is two_hosts' when it runs.
    est["exactness"] = 2 * s.compile_s + _steps_s(s, profile.two_hosts.warmup + s.steps) + (
        0 if "two_hosts" in sections else pair_seconds(profile, "host"))
  if "within_host" in sections:
    est["within_host"] = WITHIN_HOST_TIMEOUT_S / 2  # Eight trainers of small decoders.
  return {name: round(v, 1) for name, v in est.items()}


def schedule(items: list[tuple[str, float]], budget_s: float) -> set[str]:
  """The items (name, estimated seconds) that fit in `budget_s`, most valuable first.

  `items` come in order of value; each is taken if it fits in what the ones
  taken before it left, so a cheap item after one that did not fit still
  runs. A budget of 0 (or less) takes everything.

  Example:
    >>> sorted(schedule([("a", 5), ("b", 10), ("c", 4)], 10))
    ['a', 'c']
  """
  if budget_s <= 0:
    return {name for name, _ in items}
  taken, left = set(), float(budget_s)
  for name, seconds in items:
    if seconds <= left:
      taken.add(name)
      left -= seconds
  return taken


def plan_items(profile: Profile, sections: list[str], models: list[str],
               exactness_pair: bool = False) -> list[tuple[str, float]]:
  """What the budget chooses among, most valuable first: each overhead row alone (a
  section's worth of rows may be cut), every other section whole. `exactness_pair`:
  exactness runs its own pair (two_hosts is not in the run)."""
  est = plan(profile, sections, models)
  if exactness_pair:
    est["exactness"] = plan(profile, ["exactness"], models)["exactness"]
  items: list[tuple[str, float]] = []
  for name in sections:
    if name == "overhead":
      items += [(f"overhead:{k}", v) for k, v in overhead_rows(profile, models).items()]
    else:
      items.append((name, est[name]))
  return items


def budget_plan(profile: Profile, sections: list[str], models: list[str],
                budget_s: float) -> tuple[list[tuple[str, float]], set[str]]:
  """(the plan's items, those the budget keeps); the start-up comes out of the budget first."""
  items = plan_items(profile, sections, models)
  budget = budget_s - profile.startup_s if budget_s > 0 else 0
  kept = schedule(items, budget)
  if budget_s > 0 and "exactness" in kept and "two_hosts" not in kept:
    # Without two_hosts, exactness pays for its own pair: plan again with that.
    items = plan_items(profile, sections, models, exactness_pair=True)
    kept = schedule([item for item in items if item[0] != "two_hosts"], budget)
  return items, kept


def print_plan(profile: Profile, sections: list[str], models: list[str],
               budget_s: float) -> tuple[list[tuple[str, float]], set[str]]:
  """Prints each section's estimated seconds and what the budget keeps (`budget_plan`)."""
  items, kept = budget_plan(profile, sections, models, budget_s)
  print(f"plan ({profile.name}): estimated seconds per section on "
        f"{'a GPU' if profile is GPU else 'this CPU'}, compiles included"
        + (f"; budget {budget_s:g} s" if budget_s > 0 else ""))
  print(f"  {'start-up':>15} {profile.startup_s:>6.0f} s")
  for name in sections:
    mine = [(k, v) for k, v in items if k == name or k.startswith(f"{name}:")]
    runs = [k for k, _ in mine if k in kept]
    note = "" if len(runs) == len(mine) else (
        "  left out: over the budget" if not runs else
        f"  {len(runs)} of {len(mine)} rows: the rest over the budget")
    print(f"  {name:>15} {sum(v for _, v in mine):>6.0f} s{note}")
  total = sum(v for _, v in items) + profile.startup_s
  planned = sum(v for k, v in items if k in kept) + profile.startup_s
  print(f"  {'total':>15} {total:>6.0f} s" + (
      f" ({planned:.0f} s within the budget)" if budget_s > 0 else ""), flush=True)
  return items, kept


# ---- Running -----------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", help="folder for gpu_check.json (required unless --plan)")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated, from {', '.join(SECTIONS + OPTIONAL)} (run in "
                           "that order; the last only when named)")
  parser.add_argument("--models", default=None,
                      help=f"overhead and precision models, from {', '.join(GPU.models)} "
                      f"(default: {','.join(GPU.default_models)}; with --smoke: "
                      f"{','.join(SMOKE.default_models)})")
  parser.add_argument("--plan", action="store_true", help="print the plan and exit")
  parser.add_argument("--budget", type=float, default=None,
                      help=f"seconds the run may take: the sections that fit, most valuable "
                      f"first (default {GPU_BUDGET_S:g} on a GPU, none with --smoke; 0: none)")
  parser.add_argument("--profile", action="store_true",
                      help="also write a jax.profiler trace of each overhead row to DIR/profile")
  args = parser.parse_args(argv)
  if args.models is None:
    args.models = ",".join((SMOKE if args.smoke else GPU).default_models)
  for name, known in (("sections", SECTIONS + OPTIONAL), ("models", tuple(GPU.models))):
    chosen = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
    unknown = [x for x in chosen if x not in known]
    if unknown or not chosen:
      parser.error(f"--{name} {unknown or '(none)'}: choose from {', '.join(known)}.")
    setattr(args, name, chosen)
  args.sections = [n for n in SECTIONS + OPTIONAL if n in args.sections]  # Most valuable first.
  if args.budget is None:
    args.budget = 0.0 if args.smoke else float(GPU_BUDGET_S)
  if args.budget < 0:
    parser.error(f"--budget {args.budget:g}: give the seconds the run may take (0: no limit).")
  if not args.plan and not args.out:
    parser.error("--out DIR is required: the JSON goes there after every section.")
  return args


def prepare_environment(args: argparse.Namespace) -> None:
  """Sets what JAX reads at import; the caller's own settings win."""
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Tiny programs run a few steps: XLA:CPU's cheap backend passes, as the test suite uses.
    flags = os.environ.get("XLA_FLAGS", "").split()
    named = {flag.split("=")[0] for flag in flags}
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in _CHEAP_PASSES if f.split("=")[0] not in named])
  elif {"two_hosts", "exactness"} & set(args.sections):
    # XLA takes 75 % of the GPU by default, which would starve the two
    # processes of a pair (`run_pair`).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MAIN_MEMORY_FRACTION)
  # Programs compiled once per process serve the later sections, and a rerun
  # on the same machine; kept out of --out, whose files travel back.
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
      tempfile.gettempdir(), f"hetjax-gpu-check-xla-cache-{args.smoke and 'smoke' or 'gpu'}"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0" if args.smoke else "0.5")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def versions() -> dict[str, Any]:
  """The software and the device this run found."""
  from importlib import metadata
  import jax
  found = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
      found[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
      found[package] = None
  for name in ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm-plugin"):
    try:
      found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  device = jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  found["device"] = {"platform": device.platform, "kind": device.device_kind,
                     "count": jax.device_count(),
                     "memory_limit_gb": round(stats["bytes_limit"] / 2 ** 30, 1)
                     if stats and "bytes_limit" in stats else None}
  return found


def imported_packages() -> list[str]:
  """Top-level packages outside the standard library that this process imported.

  The device machine has its own Python, with JAX, Flax, optax, orbax and
  numpy but not hetjax's other dependencies: the list says what a run needed.
  """
  names = {m.split(".")[0] for m in list(sys.modules)}
  return sorted(n for n in names - set(sys.stdlib_module_names) if not n.startswith("_"))


def load_results(path: str, profile: Profile) -> dict[str, Any]:
  """The JSON of an earlier run of the same profile, whose other sections a rerun keeps."""
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("profile") == profile.name:
      return old
  return {"profile": profile.name, "sections": {}}


def write_json(path: str, results: dict[str, Any]) -> None:
  """Atomically, so a run killed mid-write leaves the last complete file."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".gpu_check-")
  with os.fdopen(fd, "w") as f:
    json.dump(results, f, indent=1, default=str)
  os.replace(tmp, path)


def run_section(name: str, ctx: Context, path: str, planned_s: float, later_s: float) -> None:
  """Runs one section; a failure is recorded in the JSON and the run goes on.

  `planned_s` is what the budget's plan gave the section (0: left out, or a
  section of no cost); it is skipped when the plan left it out or when the
  clock says it no longer fits before the budget's end. The running section
  starts no row that would eat the `later_s` seconds planned after it.
  """
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  ctx.section = {"status": "running", "started": started}
  ctx.results["sections"][name] = ctx.section
  write_json(path, ctx.results)  # A run killed in this section says so.
  t0 = time.perf_counter()
  ctx.until = ctx.end - later_s
  print(f"== {name}", flush=True)
  mine = [k for k in ctx.planned if k == name or k.startswith(f"{name}:")]
  why = None
  if not mine:
    why = ("not in the plan: over the budget (--budget); rerun it with --sections or a larger "
           "--budget")
  elif t0 + planned_s > ctx.end:
    why = f"the run fell behind its plan: its ~{planned_s:.0f} s no longer fit (--budget)"
  if why is not None:
    ctx.section.update(status="skipped", why=why, seconds=0.0)
    write_json(path, ctx.results)
    return
  try:
    body = RUNNERS[name](ctx)
    ctx.section.update(body)
    ctx.section["status"] = body.get("status", "ok")
  except Exception as e:  # pylint: disable=broad-except  (recorded; the next section runs)
    traceback.print_exc()
    ctx.section.update(status="failed", error=describe_error(e))
  ctx.section["seconds"] = round(time.perf_counter() - t0, 1)
  write_json(path, ctx.results)


def print_table(results: dict[str, Any]) -> None:
  """One table of every section's figures."""
  sections = results["sections"]
  print(f"\nhetjax GPU check ({results['profile']}): jax {results['versions'].get('jax')}, "
        f"{results['versions']['device']['kind']}")
  for name in SECTIONS + OPTIONAL:
    s = sections.get(name)
    if s is None:
      continue
    print(f"-- {name}: {s['status']} ({s.get('seconds', '?')} s)"
          + (f": {s['error']}" if "error" in s else ""))
    if "why" in s:
      print(f"   {s['why']}")
    if name == "overhead":
      print(f"   {'model':>11} {'prec':>4} {'batch':>5} {'plain ms':>9} {'hetjax ms':>9} "
            f"{'added ms':>8} {'ratio':>6} target")
      for r in s.get("rows", {}).values():
        if "plain_ms" not in r:
          print(f"   {r['model']:>11} {r['precision']:>4} {r.get('error') or r.get('skipped')}")
          continue
        print(f"   {r['model']:>11} {r['precision']:>4} {r['global_batch']:>5} "
              f"{r['plain_ms']:>9.2f} {r['hetjax_ms']:>9.2f} {r['added_ms']:>8.2f} "
              f"{r['ratio']:>6.3f} {'met' if r['meets_target'] else 'MISSED'}")
    elif name == "two_hosts":
      for reduction, r in s.get("backends", {}).items():
        said = (f"step ms {r['step_ms']}, update split over {r['split_over']} on "
                f"{r['updated_on']}, replicas equal: {r['replicas_equal']}"
                if r["status"] == "ok" else headline(r.get("error") or r.get("why") or ""))
        print(f"   {s['model']} shares {s['shares']}, reduction {reduction}: {r['status']}: "
              f"{said}")
        for mode, m in r.get("modes", {}).items():
          print(f"   {s['model']} {mode}, local steps {m['local_steps']}, reduction {reduction}: "
                f"round ms {m['round_ms']}, centres equal: {m['centres_equal']}")
    elif name == "exactness":
      for reduction, r in s.get("against", {}).items():
        print(f"   {s['model']} 1x1 against 2x1 ({reduction} reduction): "
              f"parameters within tolerance: "
              f"{r['params_equal']} (max abs diff {r['max_abs_diff']:.2e}, atol {s['atol']:g}; "
              f"max rel diff {r['max_rel_diff']:.2e}, rtol {s['rtol']:g})")
    elif name == "checkpoint":
      for mode in ("async", "sync"):
        if mode in s:
          r = s[mode]
          print(f"   {s['model']} {mode:>5}: step {r['step_s'] * 1e3:.1f} ms, save call "
                f"{r['blocking_s'] * 1e3:.1f} ms = {r['blocking_fraction']:.1%} of a step, "
                f"stall {r['stall_fraction']:.1%} (snapshot {r['snapshot_s'] * 1e3:.1f} ms, "
                f"waiting for the previous hand-over {r['handover_wait_s'] * 1e3:.1f} ms, "
                f"hand-over {r['handover_s'] * 1e3:.1f} ms)")
    elif name == "device_batches" and "rows" in s:
      print(f"   {s['model']} global batch {s['global_batch']}, blocks of {s['microbatch']}: "
            + ", ".join(f"k={k} {r['samples_s']:.1f}/s (x{r['over_k1']:.2f})"
                        for k, r in s["rows"].items()))
      print(f"   auto: {s['auto']['says']}")
    elif name == "within_host":
      for structure, r in s.get("rows", {}).items():
        print(f"   {structure:>5} (device batch {r['device_batch']}): step peak per device "
              f"{r['step_peak_on'] / 1e6:.1f} MB sharded, {r['step_peak_off'] / 1e6:.1f} MB "
              f"whole (x{r['ratio']:.2f}; mocked 1 x 4 topology)")
    elif name == "precision":
      for model, r in s.get("speedup", {}).items():
        print(f"   {model:>11}: bf16 over fp32 x{r['hetjax']:.2f} (plain loop x{r['plain']:.2f})")


def main(argv: list[str] | None = None) -> int:
  """Prints the plan, runs the sections it keeps; returns 0 when none failed."""
  args = parse_args(argv)
  profile = SMOKE if args.smoke else GPU
  t0 = time.perf_counter()  # The budget counts the start-up too.
  items, kept = print_plan(profile, args.sections, args.models, args.budget)
  if args.plan:
    return 0
  os.makedirs(args.out, exist_ok=True)
  prepare_environment(args)
  import hetjax  # After prepare_environment: JAX reads it at import.
  hetjax.initialize()
  path = os.path.join(args.out, RESULT_FILE)
  results = load_results(path, profile)
  results.update(command=" ".join([os.path.basename(sys.executable), *sys.argv]),
                 versions=versions(), plan_s=plan(profile, args.sections, args.models),
                 budget_s=args.budget, planned=[k for k, _ in items if k in kept])
  print(f"hetjax GPU check, profile {profile.name}: {json.dumps(results['versions'])}", flush=True)
  ctx = Context(profile, args.models, results, save=lambda: write_json(path, results),
                profile_dir=os.path.join(args.out, "profile") if args.profile else None,
                planned=kept, end=t0 + args.budget if args.budget > 0 else math.inf)
  section_of = lambda key: key.split(":")[0]
  for i, name in enumerate(args.sections):
    kept_s = lambda names: sum(v for k, v in items if k in kept and section_of(k) in names)
    run_section(name, ctx, path, kept_s({name}), kept_s(set(args.sections[i + 1:])))
  results["total_s"] = round(time.perf_counter() - t0, 1)
  results["packages"] = imported_packages()
  write_json(path, results)
  print_table(results)
  print(f"\nwrote {path} in {results['total_s']} s")
  return int(any(results["sections"][n]["status"] == "failed" for n in args.sections))


if __name__ == "__main__":
  sys.exit(main())
