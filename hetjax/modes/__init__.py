"""The training modes, each a strategy behind `hetjax.Trainer`'s one run lifecycle.

A reader finds how a mode trains in its own file; a new mode is one new file
implementing `base.Mode`. `sync`: one reduction per step (the default);
`rounds_mode`: what hybrid and elastic share, with a round's pieces in
`rounds` and `local_step`; `hybrid`: an outer optimizer on the hosts'
sample-weighted deltas; `elastic`: parameters pulled towards a centre (EASGD).
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
