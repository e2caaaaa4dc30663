"""`RoundsTrainer`: the former rounds trainer, now `hetjax.Trainer` with a rounds mode.

Kept for one release so that code written against it runs unchanged;
new code writes `hetjax.Trainer(..., mode=hetjax.Hybrid(...))`.
"""

from __future__ import annotations

from typing import Any, Callable

from hetjax import modes
from hetjax.config import RoundsConfig
from hetjax.trainer import Trainer, mode_attribute


class RoundsTrainer(Trainer):
  """Deprecated alias: `RoundsTrainer(task, opt, source, config, rounds)` is
  `Trainer(task, opt, source, config, mode=hetjax.modes.from_config(rounds))`.

  Example:
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer = hetjax.RoundsTrainer(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                                hetjax.TrainConfig(global_batch=32, microbatch=8),
    ...                                hetjax.RoundsConfig(mode="hybrid", round_steps=4))
    >>> trainer.fit(until=2)["mode"], trainer.round
    ('hybrid', 2)
  """

  centre = mode_attribute("centre", "What every host agrees on (`hetjax.modes.hybrid.Centre`).")
  host_params = mode_attribute("host_params", "This host's parameters (None: the centre's).")
  host_opt_state = mode_attribute("host_opt_state", "This host's (inner state, loss scale).")
  host_model_state = mode_attribute("host_model_state", "This host's model state.")

  def __init__(self, task: Any, optimizer: Any, source: Any, config: Any, rounds: RoundsConfig,
               **options: Any):
    """Args: `Trainer`'s, with `rounds` (a `RoundsConfig`) in place of `mode`."""
    super().__init__(task, optimizer, source, config, mode=modes.from_config(rounds), **options)

  @property
  def round(self) -> int:
    """The index of the next round to run."""
    return self.step

  def train_round(self) -> dict[str, float]:
    return self.train_step()

  def check_centre_agrees(self) -> None:
    self.check_params_agree()

  def fit(self, rounds: int | None = None, *,
          on_round: Callable[..., None] | None = None, **options: Any) -> dict[str, Any]:
    """`Trainer.fit` in rounds; `on_round` is `on_step`."""
    if on_round is not None:
      options["on_step"] = on_round
    return super().fit(rounds, **options)
