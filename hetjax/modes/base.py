"""What a training mode is: the strategy behind `hetjax.Trainer`'s one run lifecycle.

The Trainer owns what modes share (agreement, history, checkpoints, evaluation,
`fit`, signals, the summary); a mode owns its programs and state, how it advances
a step (or round), its part of a checkpoint and of the summary: the `Mode`
protocol. `ModeBase` gives the optional parts defaults (tests/test_mode_protocol.py
writes a mode in a test).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from hetjax import fast_variance
from hetjax import mesh as mesh_lib
from hetjax import step as step_lib
from hetjax import task as task_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.config import TrainConfig
from hetjax.input import data as data_lib
from hetjax.observe.history import History
from hetjax.step import device_batch as device_batch_lib
from hetjax.training import agreement

PyTree = Any


@dataclasses.dataclass
class Setup:
  """What the Trainer hands its mode's `build`: the run's pieces, checked and agreed once."""

  task: task_lib.Task
  optimizer: Any                     # an optax.GradientTransformation
  source: data_lib.ArraySource
  config: TrainConfig
  meshes: mesh_lib.Meshes
  sampler: data_lib.GlobalSampler
  example: dict[str, np.ndarray]     # one record, as the source gives it
  pace: Callable[..., float] | None  # emulation only
  history: History

  @property
  def first_block(self) -> dict[str, np.ndarray]:
    """The example as one block (what a model is initialised and checked on)."""
    return next(step_lib.micro_batches(self.example, self.config.microbatch))

  def agree_on_model(self, state: PyTree) -> None:
    """Every host holds a model and optimizer of the same shapes (before any collective whose
    shapes follow the model's: a stale checkout with the same command line is named, not a crash)."""
    agreement.agree_on(ckpt_lib.describe_job(state, {}), self.meshes, what="model or optimizer",
                       fix="parameter shapes or optimizer state structure differ; every host "
                       "must run the same code (check each host's checkout and installed packages).")

  def device_batches(self, params: PyTree, model_state: PyTree,
                     samples: int | None = None) -> tuple[int, ...]:
    """Every host's blocks per device at once (`config.device_batch`); the math does not change."""
    return device_batch_lib.for_hosts(self.config, self.task, params, model_state, self.example,
                                      self.meshes, samples=samples)

  def check_task(self, params: PyTree, model_state: PyTree, eval_loss: bool = True) -> None:
    """Per-example losses and metrics, checked abstractly before anything runs."""
    args = (params, model_state, self.first_block, jax.random.key(0))
    task_lib.check_contract(self.task.loss, *args)
    if eval_loss and self.task.eval_loss is not None:
      task_lib.check_contract(self.task.eval_loss, *args, what="the task's evaluation loss")

  def warn_fast_variance(self, params: PyTree, model_state: PyTree,
                         device_batches: Sequence[int]) -> tuple[str, ...]:
    """Warns once, on host 0, when device batches meet norm layers with Flax's fast variance
    (which amplifies the other kernels' rounding far past float reduction order); returns
    the layers named (empty on other hosts)."""
    if max(device_batches) <= 1 or self.meshes.host_id != 0:
      return ()
    layers = fast_variance.find(self.task.loss, params, model_state, self.first_block,
                               self.task.fast_variance_layers)
    if layers:
      shown = ", ".join(layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
      warnings.warn(
          f"device batches {','.join(map(str, device_batches))} run each block in kernels of "
          f"another shape, which round differently, and {len(layers)} normalisation layer(s) "
          f"compute Flax's fast variance E[x^2] - E[x]^2, whose cancellation amplifies that "
          f"rounding (ResNet-18: 8.7e-4 relative after one update instead of 4.1e-6): {shown}. "
          f"Build them with use_fast_variance=False (e.g. nn.BatchNorm(..., "
          f"use_fast_variance=False)) to keep results equal up to float reduction order, or run "
          f"one block per program (`device_batch` 1).", stacklevel=3)
    return layers


class Boundary(NamedTuple):
  """A point between steps where the Trainer acts (records, callbacks, checks, saves)."""

  step: int                        # steps (or rounds) done
  metrics: dict[str, float] | None  # the last step's global metrics
  stop: float = 0.0                # the stop code every host acts on here (0: none)


class Resumed(NamedTuple):
  """What a mode took back from a checkpoint: the step, the checkpoint's metadata, a note."""

  step: int
  meta: dict[str, Any]
  label: str = ""  # e.g. "elastic ": "resumed elastic from ..."
  note: str = ""   # appended to the resume line


class Loop(Protocol):
  """What `advance` reads of one `fit` call (`hetjax.training.lifecycle.Run` is one)."""

  target: int

  @property
  def records(self) -> bool: ...
  def due(self, step: int) -> bool: ...
  def record(self) -> None: ...


class Mode(Protocol):
  """A training mode: `hetjax.Sync()`, `hetjax.Hybrid(...)`, `hetjax.Elastic(...)`, or yours.

  Every host calls each method at the same point of the run.
  """

  name: str                  # 'sync', 'hybrid', ... (summary, checkpoints)
  unit: str                  # what `fit` counts, 'steps' or 'rounds'
  warmup: int                # leading steps kept out of throughput
  series: tuple[str, ...]    # the mode's own per-host history series

  def build(self, setup: Setup) -> tuple[PyTree, dict[str, Any]]:
    """Compiles, initialises; returns (a state with `params`, `opt_state` and `model_state`
    whose shapes describe the job, the mode's fields of the job): a checkpoint of another
    job is refused on resume."""
  @property
  def step(self) -> int:
    """Steps (or rounds) done, a dispatched one included."""
  def advance(self, loop: Loop) -> Iterator[Boundary]:
    """Runs up to `loop.target`, yielding at each boundary where something is due."""
  def current(self) -> tuple[PyTree, PyTree]:
    """(parameters, model state) as evaluated and reported, every update applied."""
  def agreed(self) -> tuple[PyTree, str]:
    """(what every host must hold bit for bit, on this host's devices; what it is called)."""
  def meta(self) -> dict[str, Any]:
    """The mode's part of a checkpoint's metadata (cursor, balancer, ...)."""
  def saved(self, background: bool) -> tuple[PyTree, Mesh | None]:
    """(the state to save, None) as global arrays, or with `background` a mode may give
    (this host's copy, the world mesh) for the checkpointer to wrap on its thread."""
  def restore(self, checkpointer: ckpt_lib.Checkpointer, job: dict[str, Any],
              layout: dict[str, Any]) -> Resumed | None:
    """Continues from the newest complete checkpoint of `job` (None: there is none)."""
  def summary_fields(self) -> dict[str, Any]:
    """The mode's fields of the summary, once every step's late figures are in the history."""
  def record_metrics(self, k: int) -> dict[str, float]:
    """A record's own metrics of the history's window entry `k`."""
  def close(self) -> None:
    """Stops what the mode started (threads)."""


class ModeBase:
  """Defaults for a `Mode`'s optional parts; subclass it to write a mode."""

  name = "mode"
  unit = "steps"
  warmup = 2
  series: tuple[str, ...] = ()

  def __repr__(self) -> str:  # What the hosts agree on: the same on every host.
    return f"{type(self).__name__}()"

  def meta(self) -> dict[str, Any]:
    return {}

  def record_metrics(self, k: int) -> dict[str, float]:
    del k
    return {}

  def close(self) -> None:
    pass
