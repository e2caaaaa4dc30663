"""The report's panel of where the job's time went: one bar per host, the job's mean on top.

Each bar is a host's wall time over every restart by cause, goodput first;
labels carry FLOP/s against the vendor peak, the title what the balancer saved.
"""

from __future__ import annotations

from typing import Any

from hetjax.observe import goodput as goodput_lib
from hetjax.observe import goodput_summary

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
