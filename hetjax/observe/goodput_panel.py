"""The report's panel of where the job's time went: one bar per host, the job's mean on top.

Each bar is the host's wall time over every restart, split by cause
(`hetjax.observe.goodput`): the goodput (its own compute) first, in green,
then the badput causes in the order a job meets them. Each host's label
carries its achieved FLOP/s and its fraction of the vendor peak; the title
carries the goodput and what the balancer saved against an equal split.
"""

from __future__ import annotations

from typing import Any

from hetjax.observe import goodput as goodput_lib
from hetjax.observe import goodput_summary

# Cause -> colour: compute green; startup and set-up greys; the step's parts
# blues; the lifecycle's pauses oranges; faults reds.
_COLOURS = {
    goodput_lib.COMPUTE: "#2ca02c", goodput_lib.STARTUP: "0.35", "joining": "0.5",
    "building": "0.65", "restoring": "0.8", goodput_lib.COMPILING: "#9467bd",
    goodput_lib.INPUT: "#aec7e8", goodput_lib.WAITING: "#1f77b4", goodput_lib.REDUCTION: "#17becf",
    "evaluation": "#ffbb78", "checkpoint": "#ff7f0e", "agreement": "#dbdb8d",
    "summary": "#bcbd22", goodput_lib.LOST: "#d62728", goodput_lib.DISRUPTION: "#ff9896",
    goodput_lib.RESTART_WAIT: "#8c564b", goodput_lib.OVERHEAD: "#c7c7c7",
    goodput_lib.UNTRACKED: "white",
}


def draw(ax, goodput: dict[str, Any], saving: dict[str, Any] | None, letter: str) -> None:
  """Draws the stacked bars of the job and each host into `ax`."""
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
      ax.barh(y, seconds, left=left, color=_COLOURS.get(cause, "0.9"), edgecolor="0.3",
              lw=0.3, label="compute (goodput)" if label == goodput_lib.COMPUTE else label)
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
