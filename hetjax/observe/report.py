"""`hetjax report OUT`: what a finished (or crashed) run spent its time on.

Reads OUT/metrics.jsonl (and OUT/summary.json when the run finished) and writes OUT/report.png
(`panels`: (a) each host's compute and wait as fractions of the step time, over bins of steps,
(b) the shares, (c) the throughput, (d) the evaluation with the learning rate when the run
evaluated, and where the job's time went) and OUT/report.txt, also printed. Every x axis
counts steps done, as the records do.

- efficiency = measured samples/s (the global batch over the mean step time) / ideal samples/s
  (the sum over hosts of each one's samples over its compute seconds, on the steps where it had
  samples): what the hosts would deliver if nobody ever waited and the collective were free;
- idle fraction of each host: wait / (compute + wait);
- balancer moves: decisions after warm-up that changed the split;
- the reduction's share of a step: the fastest host's wait (the collective itself, nobody
  waiting for a slower host) over the step time. The rounds modes (hybrid, elastic) reduce
  once per round instead, which pays when this share is large.

The first `WARMUP_STEPS` steps (compilation) are left out of every figure but the plots. Where
the job's time went, over every restart (`hetjax.observe.goodput`, from OUT/phases/, else
summary.json's figures): goodput, badput by cause, each host's FLOP/s against its vendor peak
and the balancer's saving against an equal split (`goodput_saving`). A rounds run (one record
per round, with `tau/<host>`, `spread/<host>` and `reduction_s`) is drawn in rounds: (b) the
hosts' local steps per round and samples, then the round and reduction seconds, and the spread
of the hosts' models (each one's distance to their sample-weighted mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Sequence

# The numbers and the drawing live beside this command; their names are
# importable from here, where tests and users found them.
from hetjax.observe.figures import (  # noqa: F401 (public names)
    SUMMARY_FILE, WARMUP_STEPS, Figures, RoundsFigures, analyze, analyze_rounds, balancer_moves,
    host_throughput, is_rounds, load_run, resumed_at, steady)
from hetjax.observe import goodput, goodput_saving, goodput_summary
from hetjax.observe.panels import BINS, binned_fractions, host_colour, plot  # noqa: F401

PNG_FILE = "report.png"
TEXT_FILE = "report.txt"


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
  lines += _last_lines(fig, "evaluation", "step")
  if fig.step_peaks:
    mb = lambda n: "?" if n is None else f"{n / 1e6:,.1f}"
    lines.append("step peak per device, MB (XLA's memory analysis; without sharding within the "
                 "host): " + ", ".join(f"host {i} {mb(p['bytes'])} ({mb(p['unsharded'])})"
                                       for i, p in enumerate(fig.step_peaks)))
  if fig.resumes:
    lines.append(f"resumed after step {', '.join(map(str, fig.resumes))} (a restart)")
  lines += goodput_summary.lines(fig.goodput, fig.balancer_saving, causes=None)
  return "\n".join(lines) + "\n"


def _last_lines(fig: Figures, evaluated: str, unit: str) -> list[str]:
  """The last evaluation (`evaluated`, after a `unit`), and each host's device batch where the
  summary records it and some host runs more than one."""
  lines = []
  if fig.last_eval is not None:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(fig.last_eval.items()))
    lines.append(f"{evaluated}: {shown} after {unit} {fig.last_eval_step} "
                 f"({_count(fig.evaluations, 'evaluation')} during training)")
  if fig.device_batches and max(fig.device_batches) > 1:
    lines.append(f"device batches (blocks per device per program): "
                 f"{'/'.join(map(str, fig.device_batches))}")
  return lines


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
  return "\n".join(lines + _last_lines(fig, "evaluation of the centre", "round")) + "\n"


def where_the_time_went(out_dir: str, summary: dict | None,
                        records: list[dict]) -> tuple[dict | None, dict | None]:
  """(goodput, balancer saving) of the run folder: from every host's phase records where
  the folder has them (complete, to each process's end), else as summary.json has them."""
  job = goodput.read_job(out_dir)
  if job is None:
    return (summary or {}).get("goodput"), (summary or {}).get("balancer_saving")
  entry = goodput_summary.from_job(job)
  saving = None
  if not is_rounds(records):
    saving = goodput_summary.saving_fields(goodput_saving.from_records(
        records, WARMUP_STEPS, steps=entry["steps_run"]))
  return entry, saving


def make_report(out_dir: str) -> tuple[Figures, str]:
  """Writes OUT/report.png and OUT/report.txt; returns the figures and the text."""
  summary, records = load_run(out_dir)
  fig = dataclasses.replace(analyze(summary, records),
                            **dict(zip(("goodput", "balancer_saving"),
                                       where_the_time_went(out_dir, summary, records))))
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
