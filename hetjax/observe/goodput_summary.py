"""The goodput figures as the summary, W&B and the report carry them, and as lines to read.

The summary is identical on every host, so each host's figures travel as one
float vector (`host_vector`) and `fields` turns the gathered rows into the
`goodput` entry; `lines` prints it. An emulated run's figures say so.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from hetjax.observe import goodput as goodput_lib
from hetjax.observe import goodput_peaks
from hetjax.observe.goodput_saving import Saving

_SECONDS = (goodput_lib.COMPUTE,) + goodput_lib.CAUSES


def host_vector(host: goodput_lib.HostTime) -> list[float]:
  """One host's figures as floats (NaN: unknown), for `fields` on every host."""
  peak = goodput_peaks.peak(host.device_kind, host.precision)
  return ([host.wall_s] + [host.seconds[c] for c in _SECONDS]
          + [host.attempts, host.redone_steps, host.steps_run,
             math.nan if host.flops_per_s is None else host.flops_per_s,
             math.nan if peak is None else peak.flops_per_s * host.devices,
             -1 if peak is None else peak.index, float(host.emulated)])


def fields(rows: Sequence[Sequence[float]]) -> dict[str, Any]:
  """The summary's `goodput` entry from every host's `host_vector` (the hosts' means)."""
  n = len(rows)
  mean = lambda k: sum(float(r[k]) for r in rows) / n
  wall = mean(0)
  seconds = {c: mean(1 + i) for i, c in enumerate(_SECONDS)}
  tail = 1 + len(_SECONDS)
  per_host = []
  for r in rows:
    flops, peak, index, emulated = (float(x) for x in r[tail + 3:tail + 7])
    known = goodput_peaks.row(int(index))
    per_host.append({
        "wall_s": float(r[0]), "compute_s": float(r[1]),
        "badput_s": {c: float(r[2 + i]) for i, c in enumerate(goodput_lib.CAUSES)},
        "goodput": float(r[1]) / float(r[0]) if r[0] > 0 else 0.0,
        "flops_per_s": None if math.isnan(flops) else flops,
        "peak_flops_per_s": None if math.isnan(peak) else peak,
        "peak_fraction": None if math.isnan(peak) or math.isnan(flops) else flops / peak,
        "peak_device": None if known is None else known[0],
        "peak_source": None if known is None else f"vendor figure: {known[1]}",
        "emulated": bool(emulated)})
  return {"fraction": seconds[goodput_lib.COMPUTE] / wall if wall > 0 else 0.0, "wall_s": wall,
          "compute_s": seconds[goodput_lib.COMPUTE],
          "badput_s": {c: seconds[c] for c in goodput_lib.CAUSES},
          "attempts": int(max(r[tail] for r in rows)),
          "redone_steps": int(max(r[tail + 1] for r in rows)),
          "steps_run": int(max(r[tail + 2] for r in rows)),
          "emulated": any(h["emulated"] for h in per_host), "per_host": per_host}


def from_job(job: goodput_lib.JobTime) -> dict[str, Any]:
  """The same entry from phase files read back (`hetjax report`)."""
  return fields([host_vector(h) for h in job.hosts])


def saving_fields(saving: Saving | None) -> dict[str, Any] | None:
  """The summary's `balancer_saving` entry."""
  if saving is None:
    return None
  return {"equal_step_s": saving.equal_step_s, "balanced_step_s": saving.balanced_step_s,
          "measured_step_s": saving.measured_step_s, "steps": saving.steps,
          "saved_s": saving.saved_s, "fraction": saving.fraction, "emulated": saving.emulated}


def flat(goodput: dict[str, Any] | None, saving: dict[str, Any] | None) -> dict[str, float]:
  """Scalars for W&B's run summary: goodput, badput_s/<cause>, host<i>/flops_per_s, ..."""
  out: dict[str, float] = {}
  if goodput:
    out["goodput"] = goodput["fraction"]
    out["job_wall_s"] = goodput["wall_s"]
    out.update({f"badput_s/{c}": s for c, s in goodput["badput_s"].items()})
    for i, h in enumerate(goodput["per_host"]):
      for key in ("flops_per_s", "peak_fraction"):
        if h[key] is not None:
          out[f"host{i}/{key}"] = h[key]
  if saving:
    out.update({f"balancer_saving/{k}": v for k, v in saving.items() if k != "emulated"})
  return out


def duration(s: float) -> str:
  """Seconds in the unit a person reads (s, min, h)."""
  if s >= 3600:
    return f"{s / 3600:.2f} h"
  return f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def _flops(x: float) -> str:
  for unit, size in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
    if x >= size:
      return f"{x / size:.2f} {unit}"
  return f"{x / 1e6:.1f} MFLOP/s"


def lines(goodput: dict[str, Any] | None, saving: dict[str, Any] | None,
          causes: int | None = 6) -> list[str]:
  """The goodput, the largest `causes` badput causes (None: every cause, one a line),
  FLOP/s per host and the saving, as text."""
  out = []
  if goodput and causes is None:
    out += table(goodput)
  elif goodput:
    tag = " (emulated speeds)" if goodput["emulated"] else ""
    wall = goodput["wall_s"]
    restarts = goodput["attempts"] - 1
    out.append(f"goodput: {goodput['fraction']:.1%} of {duration(wall)} job time trained the "
               f"model ({restarts} restart{'s' if restarts != 1 else ''}, "
               f"{goodput['redone_steps']} steps redone){tag}")
    shown = sorted(((s, c) for c, s in goodput["badput_s"].items() if s > 0), reverse=True)
    badput = ", ".join(f"{c} {s / wall:.1%}" for s, c in shown[:causes]) if wall > 0 else ""
    rest = sum(s for s, _ in shown[causes:])
    if rest > 0 and wall > 0:
      badput += f", other {rest / wall:.1%}"
    out.append(f"badput: {badput}")
  for i, h in enumerate((goodput or {}).get("per_host", [])):
    starved = h.get("badput_s", {}).get(goodput_lib.INPUT, 0.0)
    short = f", waiting for input {starved / h['wall_s']:.1%}" if starved and h["wall_s"] else ""
    out.append(f"  host {i}: " + host_flops(h) + short)
  if saving:
    ms = (f"{saving['balanced_step_s'] * 1e3:,.1f} ms against "
          f"{saving['equal_step_s'] * 1e3:,.1f} ms")
    tag = " (emulated speeds)" if saving["emulated"] else ""
    out.append(f"balancer: the split that ran is no faster than an equal split ({ms} a step, "
               f"modelled){tag}" if saving["fraction"] < 0.005 else
               f"balancer saved {saving['fraction']:.1%} of an equal split's step ({ms}, "
               f"modelled), {duration(max(saving['saved_s'], 0.0))} over {saving['steps']} "
               f"steps{tag}")
  return out


def table(goodput: dict[str, Any]) -> list[str]:
  """The job's wall time by cause, one a line, largest first (the hosts' means)."""
  wall, restarts = goodput["wall_s"], goodput["attempts"] - 1
  tag = "  (emulated speeds)" if goodput["emulated"] else ""
  out = [f"where the time went: {duration(wall)} job time over {restarts + 1} attempt(s), "
         f"{goodput['redone_steps']} steps redone (hosts' means){tag}",
         f"  {'compute (goodput)':26s} {goodput['compute_s']:9.2f} s  {goodput['fraction']:6.1%}"]
  shown = sorted(((s, c) for c, s in goodput["badput_s"].items() if s > 0), reverse=True)
  for s, c in shown:
    if wall > 0 and s / wall >= 0.0005:
      out.append(f"  {c:26s} {s:9.2f} s  {s / wall:6.1%}")
  return out


def host_flops(h: dict[str, Any]) -> str:
  """One host's achieved FLOP/s and its fraction of the vendor peak, in words."""
  tag = " (emulated)" if h["emulated"] else ""
  if h["flops_per_s"] is None:
    return f"goodput {h['goodput']:.1%}, FLOP/s unknown (no cost analysis){tag}"
  text = f"goodput {h['goodput']:.1%}, {_flops(h['flops_per_s'])} achieved{tag}"
  if h["peak_fraction"] is None:
    return text + ", peak unknown"
  return (text + f", {h['peak_fraction']:.1%} of {h['peak_device']} peak "
          f"{_flops(h['peak_flops_per_s'])} ({h['peak_source']})")
