"""How a sync step works: one cross-host reduction per step (the default mode).

Step s, on every host (docs/design.md, "One step, as the data flows"): the
balancer's share for this host -> its slice of the global batch -> the
LOCAL program over its own devices -> the one cross-host reduction, which
updates every slice of the state once and carries every host's timings ->
the balancer. The pieces live one floor down: this host's replica of the
state (`hetjax.training.replica`), the pipeline that dispatches step s and
finishes step s - 1 (`hetjax.training.pipeline`), the programs
(`hetjax.step`). Here they are wired into a `Mode`, with what a sync
checkpoint holds: the replica's whole state (the optimizer state unsplit,
so a run resumes on any number of hosts and devices, invariant 5), the
data cursor, each host's device batch and the balancer's state.
"""

from __future__ import annotations

from typing import Any, Iterator

from jax.sharding import Mesh

from hetjax import balancer as balancer_lib
from hetjax import blocks as blocks_lib
from hetjax import optimizers as optimizers_lib
from hetjax import step as step_lib
from hetjax import task as task_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.input import augment as augment_lib
from hetjax.input import loader as loader_lib
from hetjax.modes.base import Boundary, Loop, ModeBase, Resumed, Setup
from hetjax.step import optimizer_layout as layout_lib
from hetjax.step import sharding as sharding_lib
from hetjax.step import within_host as within_lib
from hetjax.step import within_host_choice
from hetjax.training import pipeline as pipeline_lib
from hetjax.training.replica import Replica

PyTree = Any
WARMUP_STEPS = 2  # Steps excluded from throughput: compilation and first transfers.


class Sync(ModeBase):
  """Synchronous data parallelism: every step, one reduction that every host joins.

  Each host computes a share of the global batch sized to its speed (the
  balancer), and the update is the one a single device would compute on
  the whole global batch (invariant 2).

  Example:
    >>> task = hetjax.models.build("mlp", kind="image", num_classes=10, hidden=(16,))
    >>> trainer = hetjax.Trainer(task, optax.sgd(0.1), hetjax.data.load("digits"),
    ...                          hetjax.TrainConfig(global_batch=32, microbatch=8),
    ...                          mode=hetjax.Sync(data_workers=0))
    >>> trainer.fit(steps=2)["balancer_mode"]
    'equal'
  """

  name, unit, warmup = "sync", "steps", WARMUP_STEPS
  series = ("input_s",)  # Each host's seconds waiting for its loader (goodput's own cause).

  def __init__(self, balancer: balancer_lib.Balancer | None = None, data_workers: int = 0):
    """Args:
      balancer: a custom split policy, overriding `TrainConfig.assignment` / `balancer`.
      data_workers: input worker processes on this host (0: threads); may differ
        between hosts (see `hetjax.input.loader`).
    """
    self._custom_balancer, self.data_workers = balancer, int(data_workers)

  def build(self, setup: Setup) -> tuple[PyTree, dict[str, Any]]:
    config, meshes, task, optimizer = setup.config, setup.meshes, setup.task, setup.optimizer
    self.config, self.meshes, self.optimizer, self.sampler = config, meshes, optimizer, setup.sampler
    initial = step_lib.init_state(task, optimizer, meshes, setup.first_block, config.seed,
                                  config.precision)
    task_lib.check_partial_blocks(task, initial.model_state, config.global_batch, config.microbatch)
    setup.agree_on_model(initial)
    self.device_batches = setup.device_batches(initial.params, initial.model_state)
    balancer = self._custom_balancer or pipeline_lib.default_balancer(config, meshes,
                                                                      self.device_batches)
    self.reduction = step_lib.make_reduction(config.reduction, meshes)
    # Every slice of the state updated by one device, then gathered: replicas
    # stay bit-identical on hosts that compile differently (invariant 6).
    self.sharded: sharding_lib.ShardedUpdate | None = None
    self.update_layout: layout_lib.Choice | None = None
    if not meshes.one_device:
      # The optimizer sees its leaves' real shapes (slices, or whole leaves).
      shard_mesh = self.reduction.shard_mesh
      self.update_layout = layout_lib.for_hosts(optimizer, initial.params, initial.opt_state,
                                                shard_mesh[0].devices.size, config.update_layout,
                                                meshes)
      self.sharded = sharding_lib.ShardedUpdate(optimizer, *shard_mesh, initial,
                                                self.update_layout.layout)
      self.reduction.sharded = self.sharded  # The update runs in the reduction's program.
    # This host's own choice: its parameters and sums split over its devices.
    self.within = within_host_choice.for_host(config, task, initial.params,
                                              initial.model_state, setup.example, meshes)
    split = None
    if self.within.on and self.sharded is not None:
      split = within_lib.Split(initial.params, meshes.local_devices)
    self.local = step_lib.LocalProgram(
        task, optimizer, meshes, config.microbatch, config.precision,
        blocks_lib.every_block_whole(config.global_batch, config.microbatch),
        replica=None if self.sharded is None else self.sharded.replica_packer,
        device_batch=self.device_batches[meshes.host_id], within=split)
    self.replica = Replica(self.local, meshes, self.sharded,
                           optimizers_lib.find_learning_rate(initial.opt_state) is not None)
    self.replica.replace(initial)
    state = self.replica.global_view()  # Per-example losses, checked before anything runs.
    setup.check_task(state.params, state.model_state)
    setup.warn_fast_variance(state.params, state.model_state, self.device_batches)
    self.loader = loader_lib.HostLoader(setup.source, setup.sampler, meshes.host_id,
                                        workers=self.data_workers,
                                        augment=augment_lib.parse(config.augment),
                                        inline_below_s=loader_lib.INLINE_BELOW_S)
    self.pipeline = pipeline_lib.StepPipeline(config, meshes, self.replica, self.reduction,
                                              self.loader, setup.example, balancer,
                                              setup.history, setup.pace)
    return state, {}

  # ---- the steps ----------------------------------------------------------

  def record_metrics(self, k: int) -> dict[str, float]:
    """Each host's seconds waiting for its input in window entry `k` (`input_s/<host>`)."""
    return {f"input_s/{host}": float(v) for host, v in enumerate(
        self.pipeline.history.series["input_s"][k])}

  @property
  def step(self) -> int:
    return self.pipeline.step

  def advance(self, loop: Loop) -> Iterator[Boundary]:
    """Overlapped steps: a step's statistics are fetched after the next one is dispatched;
    at a boundary where something is due the step in flight is finished first."""
    pipeline = self.pipeline
    for step, metrics in pipeline.boundaries(loop.target, loop.due, loop.record):
      yield Boundary(step, metrics, pipeline.take_stop() if pipeline.stopping() else 0.0)
    if loop.records and self.replica.shows_learning_rate:
      pipeline.settle_update()  # The last records carry the last update's learning rate.

  # ---- the state ------------------------------------------------------------

  @property
  def state(self) -> step_lib.TrainState:
    """The train state after every dispatched step, as global replicated arrays (what orbax
    saves, and a user may keep or replace): the pending update applied, every leaf re-wrapped
    (zero-copy), valid after later steps (the next step donates a copy); a sharded update's
    optimizer state gathered whole (a copy)."""
    return self.replica.lend(self.replica.global_view())

  @state.setter
  def state(self, state: step_lib.TrainState) -> None:
    """Replaces the train state (global replicated arrays, as `state` returns it); the
    arrays stay the caller's: the next step donates a copy of them."""
    self.replica.replace(state)
    self.replica.lend(None)

  @property
  def local_state(self) -> step_lib.TrainState:
    """This host's replica, on its own devices, every update applied; valid after later
    steps, as `state` is (a sharded update's optimizer state gathered whole: a copy)."""
    return self.replica.lend(self.replica.settled())

  @property
  def balancer(self) -> balancer_lib.Balancer:
    """The split policy the steps follow (replaceable between steps)."""
    return self.pipeline.balancer

  @balancer.setter
  def balancer(self, balancer: balancer_lib.Balancer) -> None:
    self.pipeline.balancer = balancer

  def block_until_ready(self) -> "Sync":
    """Waits for every dispatched step's work on this host's devices (for timing), without
    applying the last step's update (which waits for the next step's first program)."""
    self.replica.block_until_ready()
    return self

  def flops_of(self, rows: int) -> float | None:
    """FLOPs this host's compiled programs run for a share of `rows` samples (None: unknown)."""
    return self.local.flops_of(rows)

  def learning_rate(self) -> float | None:
    """The learning rate of the last update; None for an optimizer that hides it (found
    in an `optax.inject_hyperparams` state, as the command line builds its optimizers)."""
    return self.replica.learning_rate()

  def memory_per_device(self) -> dict[str, Any]:
    """Bytes of parameters, optimizer state and gradients one device holds, from the
    arrays' sizes: `unsplit` (every device updating a whole replica) and, when the
    update is sharded, `split` over `split_over` devices (`hetjax.step.sharding`); and
    `step_peak`, XLA's figure for a step, with and without sharding within the host."""
    memory = dict(self.replica.memory_per_device(self.config.reduction, self.optimizer))
    split = self.local.within
    memory["within_host"] = ({"split_over": 1} if split is None else
                             {"split_over": split.devices, "params": split.bytes_per_device()})
    memory["step_peak"] = self.step_peak()
    return memory

  def step_peak(self) -> dict[str, int | None]:
    """This host's step peak bytes per device (XLA's memory analysis of the largest program a
    step runs) and the same without sharding within the host (`LocalProgram.peak_bytes`)."""
    return {"bytes": self.local.peak_bytes(), "unsharded": self.local.unsharded_peak_bytes()}

  def current(self) -> tuple[PyTree, PyTree]:
    state = self.replica.applied()
    return state.params, state.model_state

  def agreed(self) -> tuple[PyTree, str]:
    return self.replica.applied().params, "parameters"

  # ---- checkpoints ------------------------------------------------------------

  def meta(self) -> dict[str, Any]:
    meta = {"data": self.sampler.state_dict(self.step), "device_batches": list(self.device_batches)}
    if hasattr(self.balancer, "state_dict"):
      meta["balancer"] = self.balancer.state_dict()
    return meta

  def saved(self, background: bool) -> tuple[PyTree, Mesh | None]:
    if background:  # A device copy; a worker thread hands it to orbax while training goes on.
      return self.replica.settled(), self.meshes.world
    return self.replica.global_view(), None

  def restore(self, checkpointer: ckpt_lib.Checkpointer, job: dict[str, Any],
              layout: dict[str, Any]) -> Resumed | None:
    """The state whole, on any layout; the balancer's state only on the same layout and
    device batches (other device batches price other programs)."""
    restored = checkpointer.restore_latest(self.replica.global_view(), job)
    if restored is None:
      return None
    state, meta = restored
    self.replica.replace(state)
    step = self.pipeline.start_step = self.sampler.restore(meta["data"])
    saved_batches = meta.get("device_batches", [1] * meta["layout"]["hosts"])
    if (meta["layout"] == layout and "balancer" in meta
        and saved_batches == list(self.device_batches) and self._load_balancer(meta["balancer"])):
      return Resumed(step, meta)
    # Another layout or policy: the old timings say nothing about these
    # hosts, so a profiling balancer warms up afresh from this step.
    if self._custom_balancer is None:
      self.balancer = pipeline_lib.default_balancer(self.config, self.meshes, self.device_batches,
                                                    start_step=step)
    return Resumed(step, meta)

  def _load_balancer(self, state: dict[str, Any]) -> bool:
    try:
      self.balancer.load_state_dict(state)
    except (ValueError, AttributeError):
      return False
    return True

  # ---- the summary --------------------------------------------------------------

  def summary_fields(self) -> dict[str, Any]:
    self.pipeline.final_waits()
    return {"balancer_mode": self.balancer.name,
            "balancer_decisions": list(getattr(self.balancer, "decisions", [])),
            "memory_per_device": self.memory_per_device(),
            "device_batches": list(self.device_batches)}

  def close(self) -> None:
    self.loader.close()
    self.pipeline.close()
