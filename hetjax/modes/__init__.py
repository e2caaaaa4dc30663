"""The training modes, each a strategy behind `hetjax.Trainer`'s one run lifecycle.

Why a folder: a reader finds how a mode trains in its own file, and a new
mode is one new file implementing `base.Mode` (the Trainer, `hetjax.trainer`,
owns everything the modes share: setup, agreement, resume, the fit loop,
checkpoints, evaluation, signals, the watchdog, the summary).

- `base.py`: the `Mode` protocol, `ModeBase` (its defaults), `Setup` (what
  a mode is built from).
- `sync.py`: `Sync`, one cross-host reduction per step (the default).
- `rounds_mode.py`: `Rounds`, what hybrid and elastic share: one round,
  its records, its checkpoints (DESIGN "Modes: one lockstep rule").
- `rounds.py`, `local_step.py`: a round's pieces: taus from speeds, the
  round's positions, the local step program, the one reduction per round.
- `hybrid.py`: `Hybrid`, an outer optimizer on the hosts' sample-weighted deltas.
- `elastic.py`: `Elastic`, per-host parameters pulled towards a centre (EASGD).

The modes' command-line flags come from `RoundsConfig`'s fields (`hetjax.cli.flags`).
"""

from __future__ import annotations

from hetjax.config import MODES, RoundsConfig  # noqa: F401 (the modes' settings, JAX-free)
from hetjax.modes.base import Boundary, Mode, ModeBase, Resumed, Setup  # noqa: F401
from hetjax.modes.elastic import Elastic
from hetjax.modes.hybrid import Hybrid
from hetjax.modes.sync import Sync


def from_config(settings: RoundsConfig | None) -> Mode:
  """The mode a `RoundsConfig` describes (None: `Sync()`), as the command line builds it.

  Example:
    >>> from_config(RoundsConfig(mode="elastic", elastic_beta=0.5))
    RoundsConfig(mode='elastic', round_steps=4, local_steps=None, local_batch=None, outer_optimizer='nesterov', outer_lr=0.7, outer_momentum=0.9, elastic_beta=0.5)
  """
  if settings is None:
    return Sync()
  s = settings
  if s.mode == "elastic":
    return Elastic(s.elastic_beta, s.round_steps, s.local_steps, s.local_batch)
  if s.mode == "hybrid":
    return Hybrid(s.round_steps, s.local_steps, s.local_batch, s.outer_optimizer, s.outer_lr,
                  s.outer_momentum)
  raise ValueError(f"unknown `mode` {s.mode!r}; choose one of {', '.join(MODES)}.")
