"""The numbers of `hetjax report`: a run folder read back and measured.

One set of figures feeds both the text (`hetjax.observe.report`) and the
picture (`hetjax.observe.panels`), and a test or a script reads a run's
efficiency without drawing anything. The definitions are in
`hetjax.observe.report`'s docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from hetjax.observe import metrics as metrics_lib

WARMUP_STEPS = 2  # As hetjax.modes.sync.WARMUP_STEPS, which this must not import (it pulls in JAX).
SUMMARY_FILE = metrics_lib.SUMMARY_FILE


@dataclasses.dataclass(frozen=True)
class Figures:
  """The numbers of a run's report (defined in `hetjax.observe.report`'s docstring)."""

  steps: int
  warmup_steps: int
  hosts: int
  global_batch: int
  measured_samples_per_sec: float
  ideal_samples_per_sec: float
  efficiency: float
  host_samples_per_sec: list[float]
  idle_fraction: list[float]
  last_shares: list[int]
  split_changes: int            # steps whose split differs from the step before
  balancer_mode: str | None
  balancer_decisions: int | None  # None without summary.json
  balancer_moves: int | None
  emulated: bool
  evaluations: int = 0          # records carrying evaluation figures
  last_eval: dict[str, float] | None = None
  last_eval_step: int | None = None
  rounds: RoundsFigures | None = None  # a hybrid or elastic run
  step_s: float = 0.0           # mean step seconds after warm-up
  reduction_s: float = 0.0      # mean of the fastest host's wait per step: the reduction itself
  resumes: list[int] = dataclasses.field(default_factory=list)  # steps a restarted run resumed at
  device_batches: list[int] | None = None  # blocks per device per program, per host (summary)
  step_peaks: list[dict] | None = None  # per host: a device's step peak bytes, and unsharded
  # Where the job's time went (hetjax.observe.goodput_summary's entries), over every restart.
  goodput: dict[str, Any] | None = None
  balancer_saving: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class RoundsFigures:
  """What a rounds-mode run adds (means over the rounds after warm-up)."""

  mode: str | None               # from summary.json: 'hybrid' or 'elastic'
  last_taus: list[int]           # local steps per host in the last round
  mean_taus: list[float]
  samples_per_round: list[float]  # per host
  round_s: float
  reduction_s: float             # the round's one cross-host reduction
  last_spread: list[float]       # ||x_i - mean|| per host, last round
  mean_spread: list[float]


def is_rounds(records: Sequence[dict[str, Any]]) -> bool:
  """Records of a hybrid or elastic run carry each host's tau in their metrics."""
  return "tau/0" in records[0]["metrics"]


def per_host(records: Sequence[dict[str, Any]], name: str, hosts: int) -> list[list[float]]:
  """`[rounds][hosts]` of the metric `name/<host>`."""
  return [[r["metrics"][f"{name}/{i}"] for i in range(hosts)] for r in records]


def analyze_rounds(summary: dict[str, Any] | None, records: list[dict[str, Any]],
                   hosts: int) -> RoundsFigures:
  run = steady(records)
  mean = lambda rows: [sum(col) / len(col) for col in zip(*rows)]
  taus, spread = per_host(run, "tau", hosts), per_host(run, "spread", hosts)
  return RoundsFigures(
      mode=(summary or {}).get("mode"),
      last_taus=[int(t) for t in per_host(records[-1:], "tau", hosts)[0]],
      mean_taus=mean(taus), samples_per_round=mean([r["shares"] for r in run]),
      round_s=sum(r["step_s"] for r in run) / len(run),
      reduction_s=sum(r["metrics"]["reduction_s"] for r in run) / len(run),
      last_spread=per_host(records[-1:], "spread", hosts)[0], mean_spread=mean(spread))


def load_run(out_dir: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
  """The run's summary (None if the run did not finish) and its metrics records."""
  hint = f"run `hetjax train ... --out {out_dir}` first"
  if not os.path.isdir(out_dir):
    raise ValueError(f"run folder {out_dir!r} does not exist; {hint}.")
  path = os.path.join(out_dir, metrics_lib.METRICS_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"{out_dir!r} has no {metrics_lib.METRICS_FILE}; {hint}.")
  records = metrics_lib.read_records(path)
  if not records:
    raise ValueError(f"{path} holds no step records (the run stopped before its first "
                     f"step ended?); {hint}.")
  summary_path = os.path.join(out_dir, SUMMARY_FILE)
  if not os.path.isfile(summary_path):
    return None, records
  with open(summary_path) as f:
    return json.load(f), records


def steady(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The records after warm-up (fewer steps: all but the first, or all)."""
  return records[WARMUP_STEPS:] or records[1:] or records


def host_throughput(records: Sequence[dict[str, Any]], host: int) -> float:
  """Samples over compute seconds of `host`, on the steps where it had samples."""
  used = [r for r in records if r["shares"][host] > 0]
  compute = sum(r["compute_s"][host] for r in used)
  return sum(r["shares"][host] for r in used) / compute if compute > 0 else 0.0


def balancer_moves(decisions: Sequence[dict[str, Any]]) -> int:
  """Decisions after warm-up whose split differs from the one before."""
  moves, previous = 0, None
  for d in decisions:
    shares = list(d["shares"])
    if previous is not None and shares != previous and not str(d.get("reason", "")).startswith("warm-up"):
      moves += 1
    previous = shares
  return moves


def analyze(summary: dict[str, Any] | None, records: list[dict[str, Any]]) -> Figures:
  """Computes the report's figures from the summary and the step records."""
  hosts = len(records[0]["shares"])
  if any(len(r["shares"]) != hosts for r in records):
    raise ValueError(f"the records disagree on the number of hosts ({hosts} at step "
                     f"{records[0]['step']}); is the folder a mix of two runs?")
  run = steady(records)
  step_s = sum(r["step_s"] for r in run)
  measured = sum(r["global_batch"] for r in run) / step_s if step_s > 0 else 0.0
  own = [host_throughput(run, i) for i in range(hosts)]
  ideal = sum(own)
  idle = []
  for i in range(hosts):
    wait, compute = sum(r["wait_s"][i] for r in run), sum(r["compute_s"][i] for r in run)
    idle.append(wait / (wait + compute) if wait + compute > 0 else 0.0)
  changes = sum(a["shares"] != b["shares"] for a, b in zip(records, records[1:]))
  reduction = sum(min(r["wait_s"]) for r in run) / len(run)
  decisions = None if summary is None else summary.get("balancer_decisions")
  emulated = any(r["emulated"] for r in records) or bool((summary or {}).get("emulated_speeds"))
  evaluated = [r for r in records if r.get("eval")]
  return Figures(
      steps=len(records), warmup_steps=len(records) - len(run), hosts=hosts,
      global_batch=records[-1]["global_batch"], measured_samples_per_sec=measured,
      ideal_samples_per_sec=ideal, efficiency=measured / ideal if ideal > 0 else float("nan"),
      host_samples_per_sec=own, idle_fraction=idle, last_shares=list(records[-1]["shares"]),
      split_changes=changes, balancer_mode=(summary or {}).get("balancer_mode"),
      balancer_decisions=None if decisions is None else len(decisions),
      balancer_moves=None if decisions is None else balancer_moves(decisions), emulated=emulated,
      evaluations=len(evaluated), last_eval=evaluated[-1]["eval"] if evaluated else None,
      last_eval_step=evaluated[-1]["step"] if evaluated else None,
      rounds=analyze_rounds(summary, records, hosts) if is_rounds(records) else None,
      step_s=step_s / len(run), reduction_s=reduction, resumes=resumed_at(records),
      device_batches=(summary or {}).get("device_batches"),
      step_peaks=(summary or {}).get("step_peak_per_host"))


def resumed_at(records: Sequence[dict[str, Any]]) -> list[int]:
  """Steps after which a restarted run went on: its clock (`time_s`) starts again there, so
  the first record of the new process holds its own step time alone (or less than before)."""
  return [a["step"] for a, b in zip(records, records[1:])
          if b["time_s"] < a["time_s"] or abs(b["time_s"] - b["step_s"]) <= 1e-9 * b["step_s"]]
