"""Synthetic metrics records of a run whose hosts have known speeds.

Host i processes one sample in `per_sample / speeds[i]` seconds, so its own
throughput is exactly `speeds[i] / per_sample` samples/s; every host waits for
the slowest, plus a fixed collective time.
"""

from __future__ import annotations

SPEEDS = (1.0, 0.5, 0.25)
PER_SAMPLE_S = 0.001
GLOBAL_BATCH = 48


def shares_at(step: int) -> list[int]:
  """Equal split for 10 steps, then a better one; host 2 idles at steps 20-21."""
  if step < 10:
    return [16, 16, 16]
  if step in (20, 21):
    return [32, 16, 0]
  return [28, 14, 6]


def records(steps: int = 30, speeds=SPEEDS, per_sample: float = PER_SAMPLE_S,
            comm_s: float = 0.002, overhead_s: float = 0.0005) -> list[dict]:
  out, t = [], 0.0
  for s in range(steps):
    shares = shares_at(s)
    compute = [b * per_sample / v + (1.0 if s == 0 else 0.0) for b, v in zip(shares, speeds)]
    slowest = max(compute)
    step_s = slowest + comm_s + overhead_s
    t += step_s
    out.append({"step": s + 1, "time_s": t, "loss": 2.3 * 0.95 ** s, "metrics": {"accuracy": s / steps},
                "samples_per_sec": GLOBAL_BATCH / step_s, "step_s": step_s,
                "global_batch": GLOBAL_BATCH, "shares": shares, "compute_s": compute,
                "wait_s": [slowest - c + comm_s for c in compute], "emulated": True})
  return out


DECISIONS = [
    {"step": 1, "shares": [16, 16, 16], "predicted_s": None, "measured_s": 0.02,
     "reason": "warm-up: equal split"},
    {"step": 3, "shares": [24, 16, 8], "predicted_s": None, "measured_s": 0.02,
     "reason": "warm-up: probe 1"},
    {"step": 10, "shares": [28, 14, 6], "predicted_s": 0.03, "measured_s": 0.03,
     "reason": "dynamic: first solve after warm-up"},
    {"step": 15, "shares": [28, 14, 6], "predicted_s": 0.03, "measured_s": 0.03,
     "reason": "dynamic: same split"},
    {"step": 20, "shares": [32, 16, 0], "predicted_s": 0.03, "measured_s": 0.03,
     "reason": "dynamic: predicted gain"},
    {"step": 22, "shares": [28, 14, 6], "predicted_s": 0.03, "measured_s": 0.03,
     "reason": "dynamic: predicted gain"},
]
