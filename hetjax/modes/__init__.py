"""The rounds modes: hybrid (local SGD across hosts) and elastic averaging (EASGD).

`sync` lives in `hetjax.trainer` / `hetjax.step`. The two modes here share
one shape (DESIGN "Modes: one lockstep rule"): inside a round each host runs
only programs over its own devices, and the round ends with exactly one
cross-host reduction that every host joins.

- `rounds.py`: what both share: the round's data positions, tau from
  speeds, the local step program, the one reduction per round.
- `hybrid.py`: how a round of hybrid works (outer optimizer on the
  sample-weighted mean of the hosts' deltas).
- `elastic.py`: how a round of elastic averaging works (a centre and
  per-host parameters pulled towards it).
- `trainer.py`: `RoundsTrainer`, the loop, checkpoints and records.
- `options.py`: the command-line flags of the modes and their checks.
"""

from hetjax.config import MODES, RoundsConfig  # noqa: F401
