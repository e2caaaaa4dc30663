"""`hetjax report OUT`: what a finished (or crashed) run spent its time on.

Reads OUT/metrics.jsonl (and OUT/summary.json when the run finished) and
writes OUT/report.png, with (a) each host's compute and wait as fractions
of the step time, averaged over bins of steps, (b) the shares over the
steps, (c) the throughput and, when the run evaluated during training, (d)
the evaluation accuracy (or loss) with the learning rate, and
OUT/report.txt, also printed. A colour always means a host (solid: compute,
pale: wait); the run-wide lines are black and grey; a dotted vertical line
marks a resume (the records' clock starts again there). Every x axis counts
steps done, as the records do.

- efficiency = measured samples/s / ideal samples/s, where measured is the
  global batch over the mean step time and ideal is the sum over hosts of
  each host's own throughput (its samples over its compute seconds, on the
  steps where it had samples): what the hosts would deliver if nobody ever
  waited and the collective were free;
- idle fraction of each host: wait / (compute + wait);
- balancer moves: decisions after warm-up that changed the split;
- the reduction's share of a step: the fastest host's wait (what the
  cross-host reduction itself costs, nobody waiting for a slower host) over
  the step time. The rounds modes (hybrid, elastic) reduce once per round
  instead of once per step, which pays when this share is large.

The first `WARMUP_STEPS` steps (compilation) are left out of every figure
but the plots.

A run of the rounds modes (hybrid, elastic: one record per round, with
`tau/<host>`, `spread/<host>` and `reduction_s` in its metrics) is drawn in
rounds: (b) becomes each host's local steps per round (tau) and samples,
and two panels join: the round and reduction seconds, and the spread of
the hosts' models (each host's distance to their sample-weighted mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from hetjax.observe import metrics as metrics_lib

WARMUP_STEPS = 2  # As hetjax.trainer.WARMUP_STEPS, which this must not import (it pulls in JAX).
SUMMARY_FILE = metrics_lib.SUMMARY_FILE
PNG_FILE = "report.png"
TEXT_FILE = "report.txt"
BINS = 60  # Panel (a) averages the steps into at most this many bins, so it stays legible.


@dataclasses.dataclass(frozen=True)
class Figures:
  """The numbers of a run's report (see the module docstring for definitions)."""

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


def _per_host(records: Sequence[dict[str, Any]], name: str, hosts: int) -> list[list[float]]:
  """`[rounds][hosts]` of the metric `name/<host>`."""
  return [[r["metrics"][f"{name}/{i}"] for i in range(hosts)] for r in records]


def analyze_rounds(summary: dict[str, Any] | None, records: list[dict[str, Any]],
                   hosts: int) -> RoundsFigures:
  run = steady(records)
  mean = lambda rows: [sum(col) / len(col) for col in zip(*rows)]
  taus, spread = _per_host(run, "tau", hosts), _per_host(run, "spread", hosts)
  return RoundsFigures(
      mode=(summary or {}).get("mode"),
      last_taus=[int(t) for t in _per_host(records[-1:], "tau", hosts)[0]],
      mean_taus=mean(taus), samples_per_round=mean([r["shares"] for r in run]),
      round_s=sum(r["step_s"] for r in run) / len(run),
      reduction_s=sum(r["metrics"]["reduction_s"] for r in run) / len(run),
      last_spread=_per_host(records[-1:], "spread", hosts)[0], mean_spread=mean(spread))


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
  summary = None
  if os.path.isfile(summary_path):
    with open(summary_path) as f:
      summary = json.load(f)
  return summary, records


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
      step_s=step_s / len(run), reduction_s=reduction, resumes=resumed_at(records))


def resumed_at(records: Sequence[dict[str, Any]]) -> list[int]:
  """Steps after which a restarted run went on: its clock (`time_s`) starts again there, so
  the first record of the new process holds its own step time alone (or less than before)."""
  return [a["step"] for a, b in zip(records, records[1:])
          if b["time_s"] < a["time_s"] or abs(b["time_s"] - b["step_s"]) <= 1e-9 * b["step_s"]]


def _count(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def format_text(fig: Figures, out_dir: str) -> str:
  """The report as a few lines of text."""
  if fig.rounds is not None:
    return _format_rounds(fig, out_dir)
  tag = "  (emulated speeds)" if fig.emulated else ""
  lines = [
      f"hetjax report: {out_dir}{tag}",
      f"{fig.steps} steps ({fig.warmup_steps} warm-up steps left out), {fig.hosts} hosts, "
      f"global batch {fig.global_batch}",
      f"throughput: {fig.measured_samples_per_sec:,.1f} samples/s measured, "
      f"{fig.ideal_samples_per_sec:,.1f} ideal; efficiency {fig.efficiency:.1%}",
      "  (ideal = sum of each host's own samples/s, its share / compute_s; "
      "efficiency = measured / ideal)",
      f"step: {fig.step_s * 1e3:,.1f} ms mean, of which the reduction {fig.reduction_s * 1e3:,.1f} "
      f"ms ({fig.reduction_s / fig.step_s if fig.step_s else 0.0:.1%}; the fastest host's wait)",
      "host  own samples/s  last share  idle",
  ]
  for i in range(fig.hosts):
    lines.append(f"{i:4d}  {fig.host_samples_per_sec[i]:13,.1f}  {fig.last_shares[i]:10d}  "
                 f"{fig.idle_fraction[i]:.1%}")
  if fig.balancer_moves is None:
    lines.append(f"balancer: unknown ({SUMMARY_FILE} missing: did the run finish?); "
                 f"the split changed {_count(fig.split_changes, 'time')}")
  else:
    lines.append(f"balancer: {fig.balancer_mode}, {_count(fig.balancer_moves, 'move')} after "
                 f"warm-up ({_count(fig.balancer_decisions, 'decision')}); the split changed "
                 f"{_count(fig.split_changes, 'time')}")
  if fig.last_eval is not None:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(fig.last_eval.items()))
    lines.append(f"evaluation: {shown} after step {fig.last_eval_step} "
                 f"({_count(fig.evaluations, 'evaluation')} during training)")
  if fig.resumes:
    lines.append(f"resumed after step {', '.join(map(str, fig.resumes))} (a restart)")
  return "\n".join(lines) + "\n"


def _format_rounds(fig: Figures, out_dir: str) -> str:
  """The report of a hybrid or elastic run: rounds, taus, reduction time and spread."""
  r = fig.rounds
  lines = [
      f"hetjax report: {out_dir}" + ("  (emulated speeds)" if fig.emulated else ""),
      f"{r.mode or 'rounds'} mode: {_count(fig.steps, 'round')} ({fig.warmup_steps} warm-up "
      f"rounds left out), {fig.hosts} hosts, {fig.global_batch} samples in the last round",
      f"round: {r.round_s * 1e3:,.1f} ms mean, of which the reduction {r.reduction_s * 1e3:,.1f} "
      f"ms ({r.reduction_s / r.round_s if r.round_s else 0.0:.1%})",
      f"throughput: {fig.measured_samples_per_sec:,.1f} samples/s measured, "
      f"{fig.ideal_samples_per_sec:,.1f} ideal; efficiency {fig.efficiency:.1%}",
      "host  own samples/s  tau (last, mean)  samples/round  spread (last, mean)  idle",
  ]
  for i in range(fig.hosts):
    lines.append(f"{i:4d}  {fig.host_samples_per_sec[i]:13,.1f}  {r.last_taus[i]:6d} "
                 f"{r.mean_taus[i]:9.2f}  {r.samples_per_round[i]:13.1f}  "
                 f"{r.last_spread[i]:9.4g} {r.mean_spread[i]:9.4g}  {fig.idle_fraction[i]:.1%}")
  lines.append("  (spread = distance of the host's model to the hosts' sample-weighted mean, "
               "at the round's end before the reduction)")
  if fig.balancer_mode is not None:
    lines.append(f"taus: {fig.balancer_mode}")
  if fig.last_eval is not None:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(fig.last_eval.items()))
    lines.append(f"evaluation of the centre: {shown} after round {fig.last_eval_step} "
                 f"({_count(fig.evaluations, 'evaluation')} during training)")
  return "\n".join(lines) + "\n"


def host_colour(i: int) -> str:
  """Host i's colour, the same in every panel (matplotlib's ten-colour cycle)."""
  return f"C{i % 10}"


def binned_fractions(records: Sequence[dict[str, Any]], hosts: int, bins: int = BINS):
  """Panel (a)'s data: bin edges (steps) and per host the compute and wait fractions of the
  step time in each bin: `(starts, ends, compute[hosts][bins], wait[hosts][bins])`.

  A fraction is seconds over the bin's step seconds, so a bin of slow steps
  weighs by its time, not by its step count.
  """
  size = max(1, -(-len(records) // bins))
  groups = [records[k:k + size] for k in range(0, len(records), size)]
  starts = [g[0]["step"] - 1 for g in groups]  # A step is drawn over [step - 1, step].
  ends = [g[-1]["step"] for g in groups]
  total = [sum(r["step_s"] for r in g) or 1.0 for g in groups]
  compute = [[sum(r["compute_s"][i] for r in g) / t for g, t in zip(groups, total)]
             for i in range(hosts)]
  wait = [[sum(r["wait_s"][i] for r in g) / t for g, t in zip(groups, total)]
          for i in range(hosts)]
  return starts, ends, compute, wait


def plot(records: list[dict[str, Any]], fig: Figures, path: str, title: str = "") -> None:
  """Draws the fractions, shares, throughput (and evaluation) panels into a PNG at `path`."""
  from matplotlib.figure import Figure  # No pyplot: no global backend, Agg by default.

  hosts = fig.hosts
  evaluated = [r for r in records if r.get("eval")]
  extra = 0 if fig.rounds is None else 2  # Round and reduction seconds; spread.
  unit = "step" if fig.rounds is None else "round"
  panels = 3 + extra + (1 if evaluated else 0)
  figure = Figure(figsize=(11, 2.2 + 0.7 * hosts + 5 + 2.5 * extra + (2.2 if evaluated else 0)),
                  layout="constrained")
  axes = figure.subplots(panels, 1, sharex=True,
                         height_ratios=[0.6 + 0.45 * hosts] + [1.2] * (panels - 1))
  _plot_fractions(axes[0], records, fig, unit)
  if fig.rounds is None:
    _plot_shares(axes[1], records, hosts)
  else:
    _plot_rounds(axes[1], axes[2], axes[3], records, fig)
  _plot_throughput(axes[2 + extra], records, fig, unit, "ce"[extra // 2])
  if evaluated:
    _plot_evaluation(axes[-1], records, evaluated, unit, "df"[extra // 2])
  for ax in axes:
    _mark_resumes(ax, fig.resumes, legend=ax is axes[0])
    ax.tick_params(labelbottom=True)  # Every panel keeps its step numbers (shared x).
  axes[-1].set_xlabel(f"{unit}s done")
  figure.suptitle(title + ("  (emulated speeds)" if fig.emulated else ""))
  figure.savefig(path, dpi=100)


def _plot_fractions(ax, records: list[dict[str, Any]], fig: Figures, unit: str) -> None:
  """(a): per host, a band whose solid part is compute and pale part wait, as step fractions."""
  hosts = fig.hosts
  starts, ends, compute, wait = binned_fractions(records, hosts)
  xs = [x for a, b in zip(starts, ends) for x in (a, b)]  # Flat over each bin.
  for i in range(hosts):
    base = hosts - 1 - i  # Host 0 on top, as the legends list them.
    c = [v for v in compute[i] for _ in (0, 1)]
    w = [cv + wv for cv, wv in zip(c, [v for v in wait[i] for _ in (0, 1)])]
    ax.fill_between(xs, base, [base + 0.9 * v for v in c], color=host_colour(i), lw=0)
    ax.fill_between(xs, [base + 0.9 * v for v in c], [base + 0.9 * min(v, 1.0) for v in w],
                    color=host_colour(i), alpha=0.3, lw=0)
    ax.axhline(base + 0.9, color="0.85", lw=0.5)
    ax.text(1.005, base + 0.45, f"wait {fig.idle_fraction[i]:.0%}", transform=ax.get_yaxis_transform(),
            va="center", fontsize=9)
  ax.set_yticks([hosts - 1 - i + 0.45 for i in range(hosts)], [f"host {i}" for i in range(hosts)])
  ax.set_ylim(-0.1, hosts)
  size = ends[0] - starts[0]
  ax.set_title(f"(a) {unit} time per host: compute (solid), wait (pale); "
               f"bins of {size} {unit}{'s' if size > 1 else ''}; right: mean wait after warm-up")


def _plot_shares(ax, records: list[dict[str, Any]], hosts: int) -> None:
  """(b): the shares, stacked so the total stays the fixed global batch."""
  steps = [records[0]["step"] - 1] + [r["step"] for r in records]  # Step s spans [s - 1, s].
  shares = [[r["shares"][i] for r in records[:1] + records] for i in range(hosts)]
  ax.stackplot(steps, shares, step="pre",
               colors=[host_colour(i) for i in range(hosts)],
               labels=[f"host {i}" for i in range(hosts)])
  ax.set_ylabel("samples")
  ax.set_title("(b) share of the global batch per host, in samples (stacked)")
  if hosts <= 12:
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _plot_throughput(ax, records: list[dict[str, Any]], fig: Figures, unit: str,
                     letter: str) -> None:
  """(c): samples/s per step, its running mean, and the ideal (the hosts' own speeds summed)."""
  steps = [r["step"] for r in records]
  sps = [r["samples_per_sec"] for r in records]
  window = 5
  mean = lambda v, k: sum(v[max(0, k - window + 1):k + 1]) / len(v[max(0, k - window + 1):k + 1])
  smooth = [mean(sps, k) for k in range(len(sps))]
  # The ideal moves when a host changes speed, so it is drawn step by step; a median, as
  # one step whose compute seconds read near zero (an asynchronous dispatch) would spike a mean.
  own = [sum(b / c for b, c in zip(r["shares"], r["compute_s"]) if b > 0 and c > 0) for r in records]
  median = lambda v, k: sorted(v[max(0, k - window + 1):k + 1])[len(v[max(0, k - window + 1):k + 1]) // 2]
  ideal = [median(own, k) for k in range(len(own))]
  # Compiling steps, at the start and after each resume, are shaded and left out of the scale.
  starts = [0] + [k + 1 for k, r in enumerate(records) if r["step"] in fig.resumes]
  warm = set()
  for n, k in enumerate(starts):
    span = records[k:k + WARMUP_STEPS]
    warm.update(range(k, k + len(span)))
    ax.axvspan(span[0]["step"] - 1, span[-1]["step"], color="0.92",
               label="warm-up" if n == 0 else None)
  ax.plot(steps, sps, color="0.65", lw=0.6, label=f"per {unit}")
  ax.plot(steps, smooth, color="k", lw=1.8, label=f"mean of {window}")
  ax.plot(steps, ideal, color="k", ls="--", lw=1, label=f"ideal (median of {window})")
  shown = sorted(v for k, v in enumerate(smooth + ideal) if k % len(smooth) not in warm)
  top = shown[int(0.95 * (len(shown) - 1))] if shown else max(smooth + ideal)
  ax.set_ylim(0, 1.15 * top or 1.0)
  ax.set_ylabel("samples/s")
  ax.set_title(f"({letter}) throughput; efficiency {fig.efficiency:.1%} of the ideal")
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _mark_resumes(ax, resumes: Sequence[int], legend: bool) -> None:
  for k, step in enumerate(resumes):
    ax.axvline(step, color="k", ls=":", lw=1.2, label="resumed" if legend and k == 0 else None)
  if legend and resumes:
    ax.legend(loc="upper left", bbox_to_anchor=(1.06, 1.0), frameon=False)


def _plot_rounds(taus, times, spread, records: list[dict[str, Any]], fig: Figures) -> None:
  """Panels (b)-(d) of a rounds run: taus and samples, round and reduction seconds, spread."""
  hosts, rounds = fig.hosts, [r["step"] for r in records]
  for i, values in enumerate(zip(*_per_host(records, "tau", hosts))):
    taus.step(rounds, values, where="pre", color=host_colour(i),
              label=f"host {i}: {fig.rounds.samples_per_round[i]:.0f} samples/round")
  taus.set_ylabel("local steps (tau)")
  taus.set_title("(b) local steps per round per host (legend: mean samples per round)")
  times.plot(rounds, [r["step_s"] for r in records], color="k", label="round")
  times.plot(rounds, [r["metrics"]["reduction_s"] for r in records], color="k", ls="--",
             label="reduction")
  times.set_ylabel("seconds")
  times.set_ylim(0, 1.2 * max(r["step_s"] for r in steady(records)))  # Round 1 compiles.
  times.set_title(f"(c) round {fig.rounds.round_s * 1e3:.0f} ms, reduction "
                  f"{fig.rounds.reduction_s * 1e3:.0f} ms (means after warm-up)")
  for i, values in enumerate(zip(*_per_host(records, "spread", hosts))):
    spread.plot(rounds, values, color=host_colour(i), label=f"host {i}")
  spread.set_ylabel("||x_i - mean||")
  spread.set_title("(d) spread: each host's distance to the hosts' sample-weighted mean")
  for ax in (taus, times, spread):
    if hosts <= 12 or ax is times:
      ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _plot_evaluation(ax, records: list[dict[str, Any]], evaluated: list[dict[str, Any]],
                     unit: str = "step", letter: str = "d") -> None:
  """The last panel: evaluation accuracy (else loss) after each evaluated step; lr on the right."""
  name = "accuracy" if "accuracy" in evaluated[0]["eval"] else "loss"
  done = [r["step"] for r in evaluated]
  ax.plot(done, [r["eval"][name] for r in evaluated], "o-", color="k", label=f"eval {name}")
  ax.set_ylabel(f"eval {name}")
  if name == "accuracy":  # An accuracy axis never runs past 1 (one evaluation alone would).
    values = [r["eval"][name] for r in evaluated]
    ax.set_ylim(max(0.0, min(values) - 0.05), min(1.0, max(values) + 0.02) + 0.005)
  seconds = sum(r["step_s"] for r in records)  # Training seconds, evaluation excluded.
  title = (f"({letter}) evaluation {name}: {evaluated[-1]['eval'][name]:.4f} after {unit} "
           f"{done[-1]} ({seconds:,.0f} s of training)")
  with_lr = [r for r in records if "lr" in r]
  if with_lr:
    lr_axis = ax.twinx()
    lr_axis.plot([r["step"] for r in with_lr], [r["lr"] for r in with_lr], color="0.5",
                 ls="--", lw=1, label="learning rate")
    lr_axis.set_ylabel("learning rate")
    lr_axis.set_ylim(0, 1.1 * max(r["lr"] for r in with_lr) or 1.0)
    lr_axis.legend(loc="lower right")
  ax.set_title(title)
  ax.legend(loc="upper left", bbox_to_anchor=(1.08, 1.0))


def make_report(out_dir: str) -> tuple[Figures, str]:
  """Writes OUT/report.png and OUT/report.txt; returns the figures and the text."""
  summary, records = load_run(out_dir)
  fig = analyze(summary, records)
  text = format_text(fig, out_dir)
  plot(records, fig, os.path.join(out_dir, PNG_FILE), title=f"hetjax run {out_dir}")
  with open(os.path.join(out_dir, TEXT_FILE), "w") as f:
    f.write(text)
  return fig, text


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The `hetjax report` arguments."""
  parser.add_argument("out", help="a run's output folder (the --out of `hetjax train`)")


def run(args: argparse.Namespace) -> int:
  """`hetjax report OUT`; returns the exit code (2 on a bad folder)."""
  try:
    _, text = make_report(args.out)
  except ValueError as e:
    print(f"hetjax report: error: {e}", file=sys.stderr)
    return 2
  print(text, end="")
  print(f"wrote {os.path.join(args.out, PNG_FILE)} and {os.path.join(args.out, TEXT_FILE)}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="hetjax report", description=__doc__.splitlines()[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
