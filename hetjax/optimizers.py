"""The command line's optimizers: optax transforms, schedules counted in updates.

`make(...)` builds `clip -> optimizer(schedule) [+ weight decay]` with
`optax.inject_hyperparams`, so each update's learning rate is in the
optimizer state, where the trainer reads it for the metrics. Weight decay
reaches kernels and embeddings, not biases and normalisation scales (as in
the Flax examples and big_vision), unless `decay_all`.

Example:
  >>> opt = make("adam", 1e-3, schedule="cosine", warmup_steps=20, total_steps=500,
  ...            clip_norm=1.0)
"""

from __future__ import annotations

from typing import Any

from hetjax.config import check_at_least, check_choice  # No JAX either.

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")
ADAMW_DEFAULT_DECAY = 1e-4  # optax.adamw's own default, kept for `--optimizer adamw`.


def decays(name: str, weight_decay: float | None) -> bool:
  """Whether these settings decay any weight (adamw decays by default)."""
  return bool(ADAMW_DEFAULT_DECAY if name == "adamw" and weight_decay is None else weight_decay)


_SPARED = ("bias", "scale")  # Flax's offsets and LayerNorm/RMSNorm/BatchNorm/GroupNorm gains.
_DECAYED = ("kernel", "embedding")


def decay_mask(params: Any) -> Any:
  """`True` for the leaves weight decay reaches: kernels and embeddings, not biases and scales.

  Decided by the leaf's Flax name, not its rank (a bias under `nn.scan` is
  `[layers, d]`); other names decay from 2 dimensions.
  """
  import jax

  def decays(path, leaf):
    key = path[-1] if path else None
    name = getattr(key, "key", getattr(key, "name", None))
    return name not in _SPARED and (name in _DECAYED or len(leaf.shape) > 1)

  return jax.tree_util.tree_map_with_path(decays, params)


def check(name: str, lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
          total_steps: int = 1, clip_norm: float | None = None,
          weight_decay: float | None = None, decay_all: bool = False) -> None:
  """Raises ValueError naming the flag, the value and the limit; imports nothing heavy."""
  check_choice("optimizer", name, OPTIMIZERS)
  check_choice("--schedule", schedule, SCHEDULES)
  if not lr > 0:
    raise ValueError(f"--lr must be > 0, got {lr}.")
  check_at_least("--warmup-steps", warmup_steps, 0)
  if warmup_steps >= total_steps and schedule != "constant":
    raise ValueError(f"--warmup-steps {warmup_steps} leaves no step of the {schedule} decay "
                     f"(--steps {total_steps}); use fewer warm-up steps.")
  if clip_norm is not None and not clip_norm > 0:
    raise ValueError(f"--clip-norm must be > 0 (a global gradient norm), got {clip_norm}.")
  if weight_decay is not None and not weight_decay >= 0:
    raise ValueError(f"--weight-decay must be >= 0, got {weight_decay}.")
  if decay_all and not decays(name, weight_decay):
    raise ValueError(f"`decay-all` chooses which leaves weight decay reaches, but --optimizer "
                     f"{name} with --weight-decay {weight_decay} decays none; give --weight-decay "
                     f"D (> 0) or drop `decay-all` from the config file.")


def learning_rate_schedule(lr: float, schedule: str, warmup_steps: int, total_steps: int):
  """lr over optimizer updates: a linear warm-up from 0, then constant, cosine or linear to 0."""
  import optax
  if schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, end_value=0.0)
  after = {"constant": optax.constant_schedule(lr),
           "linear": optax.linear_schedule(lr, 0.0, max(1, total_steps - warmup_steps))}[schedule]
  if warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), after], [warmup_steps])


def make(name: str, lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
         total_steps: int = 1, clip_norm: float | None = None,
         weight_decay: float | None = None, decay_all: bool = False):
  """The optax transformation for these command-line settings: `name` sgd, momentum, adam or
  adamw at peak `lr`; `schedule` constant, cosine or linear (to 0 at `total_steps` updates)
  after `warmup_steps` of linear warm-up from 0; `clip_norm` clips the gradient's global norm
  first; `weight_decay` is decoupled (adam becomes adamw; None: 0, adamw 1e-4), over
  `decay_mask`'s leaves unless `decay_all`.

  Example:
    >>> opt = make("adamw", 1e-3, weight_decay=0.05)  # Kernels decay, biases do not.
  """
  import optax
  check(name, lr, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
        clip_norm=clip_norm, weight_decay=weight_decay, decay_all=decay_all)
  rate = learning_rate_schedule(lr, schedule, warmup_steps, total_steps)
  decay = ADAMW_DEFAULT_DECAY if name == "adamw" and weight_decay is None else weight_decay
  mask = None if decay_all else decay_mask
  if name in ("adam", "adamw") and decay:
    inner = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=rate, weight_decay=decay, mask=mask)
  elif name in ("adam", "adamw"):
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=rate)
  else:
    momentum = 0.9 if name == "momentum" else None

    def sgd(learning_rate):
      steps = [optax.add_decayed_weights(decay, mask=mask)] if decay else []
      return optax.chain(*steps, optax.sgd(learning_rate, momentum=momentum))

    inner = optax.inject_hyperparams(sgd)(learning_rate=rate)
  return inner if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), inner)


def find_learning_rate(opt_state: Any) -> Any:
  """The `learning_rate` of the first `optax.inject_hyperparams` state in `opt_state` (None
  if hidden); works on traced states too."""
  import jax
  import optax
  kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(node, kinds) and "learning_rate" in node.hyperparams:
      return node.hyperparams["learning_rate"]
  return None
