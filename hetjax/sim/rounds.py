"""SIMULATED hybrid (and elastic: same cost) rounds on `hetjax.sim`'s cluster.

Host i runs `tau_i = max(1, round(H * v_i / v_max))` local steps with no
collective; the round ends at the last finish with ONE all-reduce of the
parameters and the outer update. Cost model, noise, spells and all-reduce are
`sim.sync`'s. THROUGHPUT only: what local steps cost in statistical
efficiency is bench/modes.py's time to accuracy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetjax.balancer import taus_from_speeds  # noqa: F401 (the trainer's own formula)
from hetjax.sim import sync as sim

SPEED_WINDOW = 8  # Rounds of local step times whose median sets tau (as hetjax.modes.rounds).

ASSUMPTIONS = (
    ("local step", "local_batch samples (default 512 per host) + the fixed cost (overhead, inner optimizer update)", "hetjax.sim's cost model"),
    ("tau", "max(1, round(H v_i / v_max)); v_i from the true costs first, then the median of the last 8 rounds' step times", "hetjax.modes.rounds.TauPolicy"),
    ("round end", "one hierarchical all-reduce of the parameters (102 MB) + the outer update (optimizer bytes / HBM)", "one reduction per round"),
    ("noise", "3 % per local step", "as hetjax.sim, per step"),
    ("slow spells", "as frequent and as long in simulated seconds as in the sync runs (rate and length rescaled from a balanced sync step to a slot, one local step of the fastest host); a host's k-th of tau steps falls in slot k H / tau", "assumed: spells happen in wall time"),
)


@dataclasses.dataclass
class RoundsResult:
  """What a simulated hybrid run measured (simulated seconds)."""

  round_steps: int
  num_hosts: int
  samples_per_s: float
  round_s: np.ndarray       # [rounds]
  compute_s: np.ndarray     # [rounds, hosts]: each host's local steps of the round
  taus: list[tuple[int, ...]]


def _slot_of_steps(tau: int, round_steps: int) -> np.ndarray:
  """Slot (of `round_steps`) each of a host's `tau` local steps falls in, spread over the round."""
  return (np.arange(tau) * round_steps) // tau


def spell_spec(spec: sim.ClusterSpec, slot_s: float, seed: int = 0) -> sim.ClusterSpec:
  """`spec` with slow spells per slot of `slot_s` seconds instead of per balanced sync step.

  Rate and length rescaled by slot / (noise-free balanced sync step), so spells are as
  frequent and as long in simulated seconds as in `sim.simulate`.
  """
  true = spec.costs(seed)
  sync_s = float(true.predict(sim.optimal_shares(spec, seed)).max()) + spec.comm_s()
  k = slot_s / sync_s
  return dataclasses.replace(spec, straggler_rate=min(1.0, spec.straggler_rate * k),
                             straggler_steps=max(1.0, spec.straggler_steps / k))


def simulate_rounds(spec: sim.ClusterSpec, round_steps: int, rounds: int = 60, *,
                    local_batch: int | None = None, measure_from: int = 10, seed: int = 0,
                    comm: bool = True, outer_update: bool = True, adapt: bool = True,
                    spells_per: str = "time", speed_window: int = SPEED_WINDOW) -> RoundsResult:
  """Runs `rounds` hybrid rounds of `round_steps` (H); throughput counts rounds from `measure_from`.

  Noise and spells are drawn per slot (one local step of the fastest host):
  `spells_per='time'` rescales them (`spell_spec`); `'slot'` does not, so H = 1
  is exactly a sync step of the equal split under the same seed. Taus come from
  the median of the last `speed_window` rounds, as the trainer's; `adapt=False`
  keeps the cost model's; `comm` and `outer_update` False leave those parts out.
  """
  if round_steps < 1:
    raise ValueError(f"round_steps (H) must be >= 1, got {round_steps}; H = 1 is one local "
                     "step per host per round.")
  b = spec.per_host_batch if local_batch is None else int(local_batch)
  if b < 1:
    raise ValueError(f"local_batch must be >= 1 sample, got {b}.")
  if not 0 <= measure_from < rounds:
    raise ValueError(f"measure_from ({measure_from}) must be in [0, rounds={rounds}).")
  if spells_per not in ("time", "slot"):
    raise ValueError(f"spells_per must be 'time' or 'slot', got {spells_per!r}.")
  if speed_window < 1:
    raise ValueError(f"speed_window must be >= 1 round, got {speed_window}.")
  n = spec.num_hosts
  true = spec.costs(seed)
  step_s = true.predict(np.full(n, b))  # Seconds of one local step, noise-free.
  drawn = spell_spec(spec, float(step_s.min()), seed) if spells_per == "time" else spec
  factors = sim.slowdowns(drawn, rounds * round_steps, seed)
  comm_s = spec.comm_s() if comm else 0.0
  hbm = np.array([sim.HBM_BYTES_PER_S[g] for g in spec.gpus])
  outer_s = float(np.max(spec.optimizer_bytes / hbm)) if outer_update else 0.0
  seen: list[np.ndarray] = []
  round_s, compute_all, taus_all = np.zeros(rounds), np.zeros((rounds, n)), []
  for r in range(rounds):
    measured = np.median(seen[-speed_window:], axis=0) if adapt and seen else step_s
    taus = taus_from_speeds(round_steps, measured)
    rows = factors[r * round_steps:(r + 1) * round_steps]
    compute = np.array([step_s[i] * rows[_slot_of_steps(t, round_steps), i].sum()
                        for i, t in enumerate(taus)])
    round_s[r] = float(compute.max()) + comm_s + outer_s
    compute_all[r] = compute
    taus_all.append(taus)
    seen.append(compute / np.asarray(taus))  # The timing vector rides the reduction.
  samples = np.array([sum(t) * b for t in taus_all], np.float64)
  rate = float(samples[measure_from:].sum() / round_s[measure_from:].sum())
  return RoundsResult(round_steps, n, rate, round_s, compute_all, taus_all)
