"""The picture of `hetjax report`: one function per panel, drawn into OUT/report.png.

A colour always means a host (solid: compute, pale: wait); the run-wide
lines are black and grey; a dotted vertical line marks a resume. matplotlib
is imported only when a picture is drawn, so the command line and the
numbers load without it.
"""

from __future__ import annotations

from typing import Any, Sequence

from hetjax.observe import goodput as goodput_lib
from hetjax.observe import goodput_summary
from hetjax.observe.figures import WARMUP_STEPS, Figures, per_host, steady

BINS = 60  # Panel (a) averages the steps into at most this many bins, so it stays legible.


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
  height = 2.2 + 0.7 * hosts + 5 + 2.5 * extra + (2.2 if evaluated else 0)
  below = 0.0 if fig.goodput is None else 2.0 + 0.25 * hosts  # Where the job's time went.
  figure = Figure(figsize=(11, height + below), layout="constrained")
  steps_part = figure
  if below:
    steps_part, time_part = figure.subfigures(2, 1, height_ratios=[height, below])
    _plot_goodput(time_part.subplots(1, 1), fig.goodput, fig.balancer_saving,
                  "defg"[extra + (1 if evaluated else 0)])
  axes = steps_part.subplots(panels, 1, sharex=True,
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
  recent = lambda v, k: v[max(0, k - window + 1):k + 1]
  smooth = [sum(recent(sps, k)) / len(recent(sps, k)) for k in range(len(sps))]
  # The ideal moves when a host changes speed, so it is drawn step by step; a median, as
  # one step whose compute seconds read near zero (an asynchronous dispatch) would spike a mean.
  own = [sum(b / c for b, c in zip(r["shares"], r["compute_s"]) if b > 0 and c > 0) for r in records]
  ideal = [sorted(recent(own, k))[len(recent(own, k)) // 2] for k in range(len(own))]
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
  for i, values in enumerate(zip(*per_host(records, "tau", hosts))):
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
  for i, values in enumerate(zip(*per_host(records, "spread", hosts))):
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


# Cause -> (grey, hatch): a colour always means a host, so causes are greys and hatches.
_STYLES = {
    goodput_lib.COMPUTE: ("0.0", ""), goodput_lib.STARTUP: ("0.55", ""), "joining": ("0.65", ""),
    "building": ("0.75", ""), "restoring": ("0.87", ""), goodput_lib.COMPILING: ("0.87", "xx"),
    goodput_lib.INPUT: ("1.0", "oo"), goodput_lib.DISPATCH: ("1.0", ".."),
    goodput_lib.WAITING: ("1.0", "//"),
    goodput_lib.REDUCTION: ("1.0", "\\\\"), "evaluation": ("0.8", ".."),
    "checkpoint": ("0.8", "//"), "agreement": ("0.8", "\\\\"), "summary": ("0.8", "++"),
    goodput_lib.LOST: ("0.5", "xx"), goodput_lib.DISRUPTION: ("0.5", ".."),
    goodput_lib.RESTART_WAIT: ("0.5", "//"), goodput_lib.OVERHEAD: ("0.95", "--"),
    goodput_lib.UNTRACKED: ("1.0", ""),
}


def _plot_goodput(ax, goodput: dict[str, Any], saving: dict[str, Any] | None, letter: str) -> None:
  """Where the job's time went: per host, its wall time over every restart by cause, goodput
  first, labelled with FLOP/s against the vendor peak; the job's mean on top; the title what
  the balancer saved."""
  hosts = goodput["per_host"]
  rows = [("job (mean)", goodput["compute_s"], goodput["badput_s"])]
  for i, h in enumerate(hosts):
    rows.append((f"host {i}: {goodput_summary.host_flops(h).split(', ', 1)[1]}",
                 h["compute_s"], h["badput_s"]))
  labelled = set()
  for y, (_, compute, badput) in enumerate(reversed(rows)):
    left = 0.0
    for cause, seconds in [(goodput_lib.COMPUTE, compute)] + list(badput.items()):
      if seconds <= 0:
        continue
      label = None if cause in labelled else cause
      labelled.add(cause)
      grey, hatch = _STYLES.get(cause, ("0.9", ""))
      ax.barh(y, seconds, left=left, color=grey, hatch=hatch, edgecolor="0.25", lw=0.3,
              label="compute (goodput)" if label == goodput_lib.COMPUTE else label)
      left += seconds
  ax.set_yticks(range(len(rows)), [r[0] for r in reversed(rows)], fontsize=8)
  ax.set_xlabel("seconds of the job's wall time (every attempt, restarts included)")
  tag = "  (emulated speeds)" if goodput["emulated"] else ""
  title = (f"({letter}) where the job's {goodput_summary.duration(goodput['wall_s'])} went: "
           f"goodput {goodput['fraction']:.1%}, {goodput['attempts'] - 1} restart(s){tag}")
  if saving:
    title += (f"\nbalancer: {saving['fraction']:.1%} of an equal split's step saved "
              f"({saving['balanced_step_s'] * 1e3:,.1f} against {saving['equal_step_s'] * 1e3:,.1f} "
              f"ms, modelled), {goodput_summary.duration(max(saving['saved_s'], 0.0))} of the job"
              + ("  (emulated)" if saving["emulated"] else ""))
  ax.set_title(title, fontsize=10)
  ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=2)
