"""The training loop and the public Python API.

The loop, one step at a time (docs/design.md, "One step, as the data flows"):
balancer -> this host's share -> its slice of the global batch -> LOCAL
program -> measured (and, under emulation, paced) compute seconds -> the
cross-host reduction, which also carries every host's timings -> balancer.
`fit` overlaps consecutive steps (docs/design.md, "Overlapped steps").
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax import config as config_lib
from hetjax.config import TrainConfig  # noqa: F401 (public name)
from hetjax.training import agreement
from hetjax.input import augment as augment_lib
from hetjax import balancer as balancer_lib
from hetjax import blocks as blocks_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.input import data as data_lib
from hetjax.training import evaluate as evaluate_lib
from hetjax.input import loader as loader_lib
from hetjax.observe import metrics as metrics_lib
from hetjax.observe import progress as progress_lib
from hetjax import optimizers as optimizers_lib
from hetjax.training import readiness
from hetjax.training import lifecycle as run_common
from hetjax.cluster import runtime
from hetjax.cluster import signals
from hetjax.cluster import watchdog
from hetjax.input import sources as sources_lib
from hetjax import mesh as mesh_lib
from hetjax.step import sharding as sharding_lib
from hetjax import step as step_lib
from hetjax import task as task_lib
from hetjax.observe.history import History
from hetjax.cluster.signals import Interrupted, Preempted, Stopped  # noqa: F401 (public names)
from hetjax.task import Task

PyTree = Any
WARMUP_STEPS = 2  # Steps excluded from throughput: compilation and first transfers.
# Set by the launchers' emulation flags; named here so that `hetjax.cluster.emulate`
# is imported only when something is emulated.


# One program for the whole tree: copied op by op, each leaf shape would compile its own.
_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def params_digest(params: PyTree) -> str:
  """sha256 over the float32 bytes of the parameter leaves, in tree order."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(params):
    h.update(np.ascontiguousarray(np.asarray(leaf, dtype=np.float32)).tobytes())
  return h.hexdigest()


class _InFlight(NamedTuple):
  """A step whose programs are dispatched and whose results are not yet fetched."""

  step: int
  shares: tuple[int, ...]
  t0: float                          # when its dispatch began
  t1: float                          # when its local programs were dispatched (and paced)
  ready: readiness.Pending | None    # when its local sums, then its update, were ready
  paced: float | None                # emulated compute seconds (emulation only)
  reduced: step_lib.Reduced


class Trainer:
  """Synchronous data parallelism over whatever hosts this process belongs to.

  Example:
    >>> hetjax.initialize()
    >>> trainer = hetjax.Trainer(task, optax.adam(1e-3), source,
    ...                          hetjax.TrainConfig(global_batch=64))
    >>> summary = trainer.fit(steps=100)
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, config: TrainConfig, *,
               balancer: balancer_lib.Balancer | None = None,
               pace: Callable[[float, int], float] | None = None, identity: str = "",
               checkpoint: ckpt_lib.CheckpointConfig | None = None, data_workers: int = 0):
    """Validates everything, agrees with the other hosts, then initialises.

    Args:
      task: the model (`hetjax.from_functions`, `from_linen`, `from_nnx`).
      optimizer: any optax transformation.
      source: random-access records (`len`, `source[indices] -> batch`).
      config: the settings every host must share.
      balancer: overrides `config.assignment` with a custom split policy.
      pace: `pace(compute_s, step, samples) -> seconds to report`, called
        with each step's real local compute seconds and the samples this host
        computed (padded micro-batches); only for emulation (default: from
        HETJAX_SPEED / HETJAX_SLOWDOWN / HETJAX_DEVICE_SAMPLE_MS).
      identity: extra text the hosts must agree on (e.g. the command line);
        a checkpoint written under another identity is refused.
      checkpoint: where and how often to save; with `resume`, the trainer
        continues from the newest complete checkpoint there, also when it was
        written by another number of hosts.
      data_workers: input worker processes on this host (0: threads); may
        differ between hosts (see `hetjax.input.loader`).
    """
    if int(os.environ.get(config_lib.Env.NUM_HOSTS, "1")) > 1 and not runtime.is_initialized():
      raise RuntimeError(f"{config_lib.Env.NUM_HOSTS} asks for several hosts but the cluster is not joined: "
                         "call hetjax.initialize() before building a Trainer.")
    config.validate()
    if checkpoint is not None:
      checkpoint.validate()  # An unwritable folder fails before anything compiles.
    self.task, self.optimizer, self.source, self.config = task, optimizer, source, config
    self.meshes = mesh_lib.Meshes.create()
    self.host_id, self.num_hosts = self.meshes.host_id, self.meshes.num_hosts
    self._custom_balancer = balancer is not None
    self.balancer = balancer or self._default_balancer(start_step=0)
    self.sampler = data_lib.GlobalSampler(len(source), config.global_batch, config.seed,
                                          name=source.info.name)
    self._check_hosts_agree(f"{identity}|{checkpoint!r}")
    self.emulated = pace is not None or config_lib.emulated_from_env()
    if pace is None and self.emulated:
      from hetjax.cluster import emulate  # Emulation stays off the real path.
      pace = emulate.pacing_from_env(self.host_id)
    self.pace = pace
    self.loader = loader_lib.HostLoader(source, self.sampler, self.host_id, workers=data_workers,
                                        augment=augment_lib.parse(config.augment),
                                        inline_below_s=loader_lib.INLINE_BELOW_S)
    self._example = source[np.arange(1)]
    task_lib.check_batch_keys(list(self._example))
    # Records that disagree with one another fail here, not mid-run.
    sources_lib.check_records(source, sources_lib.record_spec(source))
    init_batch = next(step_lib.micro_batches(self._example, config.microbatch))
    # The train state lives on this host's devices. In a world of one device
    # the last step's update is applied by the next step's first program
    # (`hetjax.step.LocalProgram`); in a larger one the reduction updates
    # each slice of the state once (`hetjax.step.sharding`) and the next program
    # unpacks the gathered result.
    self._live: step_lib.TrainState
    self._pending: tuple[int, jax.Array] | None = None  # (step, its summed row) not yet applied
    self._global: tuple[step_lib.TrainState, step_lib.TrainState] | None = None
    self._whole: tuple[step_lib.TrainState, step_lib.TrainState] | None = None
    # The replica whose buffers `state` / `local_state` handed out (or the
    # setter took in): the next step donates a copy instead, so what a user
    # holds is never deleted under them.
    self._lent: step_lib.TrainState | None = None
    self._late_lr: dict[int, jax.Array] = {}  # step -> its update's learning rate, not yet read
    initial = step_lib.init_state(task, optimizer, self.meshes, init_batch, config.seed,
                                  config.precision)
    # Before any collective whose shapes follow the model's: a stale checkout
    # with the same command line must be named, not crash a collective.
    self._agree_on(ckpt_lib.describe_job(initial, {}), what="model or optimizer",
                   fix="parameter shapes or optimizer state structure differ; every host must "
                   "run the same code (check each host's checkout and installed packages).")
    self.reduction = step_lib.make_reduction(config.reduction, self.meshes)
    # Every slice of the state updated by one device, then gathered (issue 25):
    # replicas stay bit-identical on hosts that compile differently.
    self.sharded: sharding_lib.ShardedUpdate | None = None
    self._shards: sharding_lib.Shards | None = None
    self._memory: dict[str, Any] | None = None  # `memory_per_device`, once asked
    if not self.meshes.one_device:
      self.sharded = sharding_lib.ShardedUpdate(optimizer, *self.reduction.shard_mesh, initial)
      self.reduction.attach(self.sharded)
    self._shows_learning_rate = optimizers_lib.find_learning_rate(initial.opt_state) is not None
    self.local = step_lib.LocalProgram(
        task, optimizer, self.meshes, config.microbatch, config.precision,
        blocks_lib.every_block_whole(config.global_batch, config.microbatch),
        replica=None if self.sharded is None else self.sharded.replica_packer)
    self._replace_state(initial)
    self._check_contract(init_batch)
    self.history = History()
    # XLA:CPU's "devices" are the loop's own cores: stamped where the loop looks.
    self._clock = readiness.ReadyClock(
        on_loop=self.meshes.local.devices.flat[0].platform == "cpu")
    self._flight: _InFlight | None = None  # The step dispatched but not yet fetched.
    self._timings: dict[int, tuple[float, float]] = {}  # step -> this host's (compute, wait)
    self._shares_of: dict[int, tuple[int, ...]] = {}    # step -> shares, for the balancer
    self._observations: list[tuple[int, int, list[float]]] = []  # (from step, step, compute)
    self._last_update_ready: float | None = None
    self._start_step = 0
    self._base_key = jax.random.key(config.seed)
    self._stop_code = 0.0  # The largest stop signal any host sent (hetjax.cluster.signals).
    self._stop_at: int | None = None  # The step boundary where every host acts on it.
    self._evaluator: evaluate_lib.Evaluator | None = None
    self.resumed_from: int | None = None
    self.job = ckpt_lib.describe_job(self._global_state(), {
        "global_batch": config.global_batch, "seed": config.seed,
        "dataset": repr(source.info), "num_records": len(source), "identity": identity})
    self.checkpointer = None
    if checkpoint is not None:
      self.checkpointer = ckpt_lib.Checkpointer(checkpoint, self._all_hosts_agree)
      if checkpoint.resume:
        self._resume()

  @property
  def state(self) -> step_lib.TrainState:
    """The train state after every dispatched step, as global replicated arrays.

    What orbax saves and what a user may inspect, keep or replace. Applies a
    pending update first (`local_state`) and re-wraps every leaf (zero-copy,
    ~15 us a leaf), so the step loop never reads it. The arrays stay valid
    after later steps: the next step copies the state once before donating
    it (`block_until_ready` waits without that). In a world of several
    devices the optimizer state lives split over them (`hetjax.step.sharding`);
    this view holds it whole, gathered for the read (a copy).
    """
    view = self._global_state()
    self._lent = self._live
    return view

  @state.setter
  def state(self, state: step_lib.TrainState) -> None:
    """Replaces the train state (given as global replicated arrays, as `state` returns it).

    The arrays stay the caller's: the next step donates a copy of them.
    """
    self._replace_state(state)
    self._lent = self._live

  @property
  def local_state(self) -> step_lib.TrainState:
    """This host's replica of the train state, on its own devices, every update applied.

    The last step's update (one device) or its gathered result (several)
    waits for the next step's first program; reading the state applies it
    alone, with the same function. Valid after later steps, as `state` is.
    In a world of several devices the optimizer state is gathered whole
    from its slices for this read (a copy; the run keeps it split).
    """
    live = self._settled_state()
    self._lent = self._live
    return live

  def _replica(self) -> step_lib.TrainState:
    """This host's replica, every update applied; under the sharded update without
    its optimizer state (parameters, model state, step, loss scale)."""
    self._apply_pending()
    return self._live

  def _settled_state(self) -> step_lib.TrainState:
    """`local_state` for the trainer's own reads, which keep nothing past the next step.

    Under the sharded update the optimizer state is gathered from its
    slices here (cached per step): checkpoints keep the unsplit layout, so
    a run resumes on any number of hosts and devices (invariant 5).
    """
    live = self._replica()
    if self.sharded is None:
      return live
    if self._whole is None or self._whole[0] is not live:
      self._whole = (live, live._replace(opt_state=self.sharded.local_opt_state(
          self._shards, self.meshes)))
    return self._whole[1]

  def _global_state(self) -> step_lib.TrainState:
    """`state` for the trainer's own reads (orbax, the job's description); cached per step."""
    whole = self._settled_state()
    if self._global is None or self._global[0] is not whole:
      self._global = (whole, mesh_lib.to_global_tree(whole, self.meshes))
    return self._global[1]

  def _replace_state(self, state: step_lib.TrainState) -> None:
    live, pending = mesh_lib.to_local_tree(state, self.meshes), None
    if self.sharded is not None:
      self._shards = self.sharded.split(state)
      live = live._replace(opt_state=None)
      # Each device initialised (or restored) its own copy; the replicas take
      # each slice from the one device that holds it, as after every update.
      pending = (None, self.sharded.replica(self._shards, self.meshes))
    self._live, self._pending, self._global, self._whole = live, pending, None, None

  def _apply_pending(self) -> None:
    """Applies the last step's update alone, if it still waits for a program."""
    if self._pending is not None:
      step, total = self._pending
      self._live, lr = self.local.update(self._live, total)
      self._pending = None
      if self._shows_learning_rate and lr is not None:
        self._late_lr[step] = lr

  def block_until_ready(self) -> "Trainer":
    """Waits until every dispatched step's work on this host's devices is done.

    For timing: unlike reading `state`, it does not apply the last step's
    update, which waits for the next step's first program (`local_state`).
    """
    jax.block_until_ready((self._live, self._pending, self._shards))
    return self

  def _read_learning_rates(self, before: int | None = None) -> None:
    """Records the learning rate of every applied update of a step before `before`.

    Read here, not from the step's statistics: an update runs in the next
    step's program. Called when those programs are done, so it waits for nothing.
    """
    due = [s for s in self._late_lr if before is None or s < before]
    if not due:
      return
    values = jax.device_get([self._late_lr.pop(s) for s in due])
    for s, lr in zip(due, values):
      index = s - self._start_step
      if index >= self.history.dropped:
        self.history.lr[index] = float(lr)

  def _settle_update(self) -> None:
    """Applies the last update and reads every learning rate due: every host, same step."""
    self._apply_pending()
    self._read_learning_rates()

  def _default_balancer(self, start_step: int) -> balancer_lib.Balancer:
    """The configured policy, deciding in blocks (one device round = granularity)."""
    config = self.config
    options = {}
    if config.balancer in ("static", "dynamic"):
      options["start_step"] = start_step
    return blocks_lib.make_block_balancer(
        config.assignment, config.global_batch, config.microbatch,
        self.meshes.devices_per_host(), mode=config.balancer, **options)

  def _check_contract(self, block: dict[str, np.ndarray]) -> None:
    """Per-example losses and metrics, checked abstractly before anything runs."""
    rng = jax.random.key(0)
    state = self._global_state()
    args = (state.params, state.model_state, block, rng)
    task_lib.check_contract(self.task.loss, *args)
    if self.task.eval_loss is not None:
      task_lib.check_contract(self.task.eval_loss, *args, what="the task's evaluation loss")

  def _all_hosts_agree(self, flag: bool) -> bool:
    return run_common.all_hosts_agree(flag, self.meshes)

  def _layout(self) -> dict[str, Any]:
    return run_common.layout(self.meshes, self.config.microbatch)

  def _checkpoint_meta(self) -> dict[str, Any]:
    meta = {"job": self.job, "layout": self._layout(), "data": self.sampler.state_dict(self.step)}
    if hasattr(self.balancer, "state_dict"):
      meta["balancer"] = self.balancer.state_dict()
    return meta

  def _resume(self) -> None:
    """Continues from the newest complete checkpoint, if the folder has one."""
    restored = self.checkpointer.restore_latest(self._global_state(), self.job)
    if restored is None:
      return
    state, meta = restored
    self._replace_state(state)
    step = self.sampler.restore(meta["data"])
    self._start_step = self.resumed_from = step
    try:
      if meta["layout"] != self._layout() or "balancer" not in meta:
        raise ValueError("another host layout")
      self.balancer.load_state_dict(meta["balancer"])
    except (ValueError, AttributeError):
      # Another layout or policy: the old timings say nothing about these
      # hosts, so a profiling balancer warms up afresh from this step.
      if not self._custom_balancer:
        self.balancer = self._default_balancer(start_step=step)
    if self.host_id == 0:
      print(f"hetjax: resumed from {self.checkpointer.directory}/{step} (written by "
            f"{meta['layout']['hosts']} host(s) x {meta['layout']['devices_per_host']} device(s))",
            flush=True)

  def _check_hosts_agree(self, identity: str) -> None:
    mine = f"{self.config!r}|{self.source.info!r}|{len(self.source)}|{identity}"
    self._agree_on(mine, what="configuration",
                   fix="(config hash mismatch): every host must run the same command and arguments.")

  def _agree_on(self, description: Any, *, what: str, fix: str) -> None:
    everyone = mesh_lib.gather_host_values(
        agreement.text_fingerprint(repr(description)), self.meshes)
    agreement.check_all_equal(everyone, what=what, fix=fix)

  def check_params_agree(self) -> None:
    """Compares every host's parameter fingerprint (every host must call it).

    Raises:
      agreement.HostsDisagree: naming the hosts whose replicas differ.
    """
    params = self._replica().params
    rows = mesh_lib.gather_host_values(agreement.params_fingerprint(params), self.meshes)
    agreement.check_fingerprints(self.step, rows)

  @property
  def step(self) -> int:
    """The index of the next step to run (a dispatched step counts as run)."""
    return self._start_step + self.history.steps + (self._flight is not None)

  def train_step(self) -> dict[str, float]:
    """Runs one synchronous step on every host; returns its global metrics.

    `fit` overlaps steps instead: it fetches a step's metrics after
    dispatching the next one, so the devices never wait for Python.
    """
    self._drain()  # A step `fit` left in flight.
    self._flight = self._dispatch()
    return self._drain()

  def _dispatch(self) -> "_InFlight":
    """Launches one step (local programs, then the reduction) without waiting for it.

    The rows carry this host's compute and wait seconds of step `s - 2`,
    known by then whether or not the loop overlaps steps, and the balancer
    decides step `s` from rows up to step `s - 2`: every host follows the
    same figures at the same step, overlapped or not (invariant 3).
    """
    step = self.step
    watchdog.entered(step)
    t0 = time.perf_counter()
    self._look_at_last_step()
    self._feed_balancer(step)
    block = self.config.microbatch
    shares = blocks_lib.check_aligned(balancer_lib.validate_shares(
        self.balancer.shares(step), self.config.global_batch, self.num_hosts),
        self.config.global_batch, block)
    self._shares_of[step] = shares
    batch = self.loader.get(step, shares)
    self.loader.prefetch(step + 1, shares)  # A guess: shares rarely change.
    timed = self._timings.pop(step - 2, (0.0, 0.0))
    host_values = np.array([*timed, signals.REQUESTS.code, *shares], np.float32)
    self._look_at_last_step()
    applied, pending = self._pending or (None, None)
    if self._lent is self._live:
      self._live = _copy_tree(self._live)  # Donated below; the lent one stays.
    self._lent = None
    local = self.local(self._live, pending, batch, self._example, self._base_key, step,
                       blocks_lib.first_block(shares, self.host_id, block), host_values)
    self._live, self._pending, sums = local.state, None, local.sums
    if applied is not None and self._shows_learning_rate and local.learning_rate is not None:
      self._late_lr[applied] = local.learning_rate
    paced = None
    if self.pace is not None:
      jax.block_until_ready(sums)
      unit = self.config.microbatch * self.meshes.local_devices
      # Paced steps are finished one by one: the devices were idle at t0.
      paced = self.pace(time.perf_counter() - t0, step, -(-shares[self.host_id] // unit) * unit)
    t1 = time.perf_counter()
    watchdog.reducing(step)
    if self.sharded is None:
      reduced = self.reduction(sums)
    else:  # The update runs in the reduction: its learning rate is known at once.
      reduced = self.reduction(sums, self._shards)
      self._shards = reduced.shards
      if self._shows_learning_rate:
        self._late_lr[step] = reduced.learning_rate
    self._pending = (step, reduced.total)
    ready = None
    if self.pace is None:
      ready = self._clock.defer(sums, reduced.report)
      # The step before first, so that stamps taken on the loop never run backwards.
      self._look_at_last_step()
      ready.look()
    return _InFlight(step, shares, t0, t1, ready, paced, reduced)

  def _look_at_last_step(self) -> None:
    """Stamps the step in flight's stages done by now (on XLA:CPU; else a no-op)."""
    if self._flight is not None and self._flight.ready is not None:
      self._flight.ready.look()

  def _finish(self, flight: "_InFlight") -> dict[str, float]:
    """Fetches a dispatched step's statistics and rows; records and checks them."""
    stats, rows = flight.reduced.fetch()
    watchdog.completed(flight.step)
    fetched = time.perf_counter()
    step, shares = flight.step, flight.shares
    code = float(rows[:, 2].max())
    if code and self._stop_at is None:
      # Acted on two steps later: by then every host has this row, whether
      # or not its loop overlaps steps.
      self._stop_code, self._stop_at = code, step + 2
    if self.pace is None:
      local_ready, update_ready = flight.ready.result()
      # The devices start a step when the previous update is done, or when it is dispatched.
      busy_from = max(flight.t0, self._last_update_ready or flight.t0)
      self._timings[step] = (local_ready - busy_from, update_ready - local_ready)
    else:
      update_ready = fetched
      self._timings[step] = (flight.paced, fetched - flight.t1)
    self._last_update_ready = update_ready
    h = self.history
    h.shares.append(shares)
    timed = step - 2
    if timed >= self._start_step:  # Every host's compute and wait seconds of step s - 2.
      if h.dropped + len(h.compute_s) == timed - self._start_step:  # Not yet gathered by summary().
        h.compute_s.append([float(r) for r in rows[:, 0]])
        h.wait_s.append([float(r) for r in rows[:, 1]])
      self._observations.append((step, timed, rows[:, 0].tolist()))
    h.step_s.append(fetched - flight.t0)
    self._read_learning_rates(before=step)
    metrics = {k: float(v) for k, v in stats.items() if k != "count"}
    h.loss.append(metrics["loss"])
    h.metrics.append(metrics)
    # Checked once recorded: the update has happened, whatever the check says.
    agreement.check_shares(step, rows[:, 3:3 + self.num_hosts])
    if stats["count"] <= 0:
      raise RuntimeError(f"step {step}: the hosts processed 0 examples in total; the "
                         f"assignment {shares} must give the global batch at least one sample.")
    return metrics

  def _drain(self) -> dict[str, float] | None:
    """Finishes the step in flight, if any; its metrics."""
    flight, self._flight = self._flight, None
    return None if flight is None else self._finish(flight)

  def _feed_balancer(self, step: int) -> None:
    """Gives the balancer the figures that arrived with steps up to `step - 2`."""
    while self._observations and self._observations[0][0] <= step - 2:
      _, timed, compute = self._observations.pop(0)
      self.balancer.observe(timed, self._shares_of[timed], compute)
    for old in [s for s in self._shares_of if s < step - 4]:
      del self._shares_of[old]

  def fit(self, steps: int | None = None, *, until: int | None = None, log_every: int = 0,
          log: Callable[[str], None] = print,
          on_step: Callable[["Trainer", dict[str, float]], None] | None = None,
          sinks: Sequence[Callable[[dict[str, Any]], Any]] = (), eval_every: int = 0,
          eval_source: data_lib.ArraySource | None = None, out: str | None = None) -> dict[str, Any]:
    """Runs `steps` more steps, or until step `until`; returns the summary (same on every host).

    With a checkpoint folder it saves every `every` steps and at the end.
    SIGTERM or Ctrl-C (SIGINT) to any host makes every host stop at the same
    step boundary (within two steps), save when there is a checkpoint folder,
    and raise `Preempted` (SIGTERM) or `Interrupted` (SIGINT).

    Steps overlap: a step's statistics are fetched after the next step is
    dispatched, so the devices never wait for Python. Where something
    happens (logging, evaluation, a check, a checkpoint, a stop, `on_step`),
    the loop first finishes the step in flight.

    Args:
      steps: how many steps to run from here.
      until: the step to stop at (a resumed job runs only what is left).
      log_every: host 0 logs every this many steps (0: never).
      log: where log lines go.
      on_step: called after every step with the trainer and the step's
        metrics (the loop then finishes every step before the next).
      sinks: fed one complete per-step record each (`hetjax.observe.metrics` schema),
        e.g. `MetricsWriter.write` or `Progress.update`; a step's record
        comes two steps late, when its wait seconds are known.
      eval_every: evaluate on `eval_source` every this many steps (0: only
        at the end, when `eval_source` is given); the figures go into the
        records (`eval`) and the summary, the time spent off the step clock.
      eval_source: the split to evaluate on (every host reads a slice).
      out: a run folder: process 0 writes summary.json, metrics.jsonl and
        TensorBoard events there, as `hetjax train --out` does, so
        `hetjax report OUT` reads API runs too.
    """
    run_common.check_fit_args(steps, until, eval_every, eval_source, "steps")
    target = self.step + steps if until is None else until
    if log_every:  # The progress line of `hetjax train`, through `log`.
      sinks = [*sinks, progress_lib.log_sink(target, host_id=self.host_id, every=log_every, log=log)]
    writer, sinks = run_common.open_run_folder(out, self.host_id, self.step, sinks)
    # Records are built only for someone to read them: the step loop stays lean.
    stream = None if not sinks else metrics_lib.RecordStream(
        self.history, global_batch=self.config.global_batch, emulated=self.emulated,
        first_step=self._start_step, sinks=sinks)
    try:
      with signals.REQUESTS.installed(), watchdog.watching(self.config.watchdog_s, self.host_id,
                                                            self.num_hosts):
        self._drain()  # A step an earlier call left in flight.
        try:
          while self.step < target:
            previous = self._flight
            self._flight = self._dispatch()
            if previous is not None:  # Fetched now that the next step keeps the devices busy.
              self._finish(previous)
              self._record(stream)
            step = self.step
            every = lambda n: bool(n) and step % n == 0
            checkpoint_due = self.checkpointer is not None and every(self.checkpointer.config.every)
            stopping = self._stop_at is not None and step >= self._stop_at
            if not (step >= target or stopping or on_step is not None or self.pace is not None
                    or every(eval_every) or every(self.config.check_every)
                    or checkpoint_due):
              continue
            metrics = self._drain()  # A step boundary where something happens.
            if every(eval_every):
              self._evaluate_into_history(eval_source)
            self._record(stream)
            if on_step is not None:
              on_step(self, metrics)
            if stopping:
              self._stop(stream, out)
            if every(self.config.check_every):
              self.check_params_agree()
            if checkpoint_due:
              self.save_checkpoint()
        except Exception:
          self._settle_after_error()
          raise
      if stream is not None and self._shows_learning_rate:
        self._settle_update()  # The last records carry the last update's learning rate.
      # Also when nothing was left to run (a finished job started again).
      if eval_source is not None and (self.history.steps - 1) not in self.history.evals:
        self._evaluate_into_history(eval_source)
      return run_common.close_run(self.checkpointer, lambda: self.save_checkpoint(wait=True),
                                  self.summary, stream.pop if stream else lambda: None, out,
                                  self.host_id)
    finally:
      if writer is not None:
        writer.close()

  def _settle_after_error(self) -> None:
    """Finishes the step still in flight, so the trainer's step matches its state.

    That step's update has already happened on every host; its own error,
    if any, is dropped: the first one is the one raised.
    """
    try:
      self._drain()
    except Exception:  # noqa: BLE001 (reported through the error being raised)
      pass

  def _record(self, stream: metrics_lib.RecordStream | None) -> None:
    """Hands the complete records to the sinks; keeps the history's memory O(1) in steps."""
    if stream is not None:
      stream.pop()
    self.history.trim(WARMUP_STEPS)

  def _stop(self, stream: metrics_lib.RecordStream | None, out: str | None) -> None:
    """Every host got the stop flag in the same step: save, write what is known, raise."""
    code, self._stop_code, self._stop_at = self._stop_code, 0.0, None
    self._settle_update()
    run_common.stop_run(code, self.step, self.checkpointer, lambda: self.save_checkpoint(wait=True),
                        self.summary, stream.pop if stream else lambda: None, out, self.host_id)

  def _evaluate_into_history(self, source: data_lib.ArraySource) -> None:
    figures = self.evaluate(source)
    self.history.evals[self.history.steps - 1] = figures

  def learning_rate(self) -> float | None:
    """The learning rate of the last update, when the optimizer exposes it.

    Found in an `optax.inject_hyperparams` state (the command line builds its
    optimizers that way); None for an optimizer that hides it.
    """
    self._apply_pending()
    opt_state = self._live.opt_state if self.sharded is None else self._shards.opt_state
    lr = optimizers_lib.find_learning_rate(opt_state)  # A scalar: replicated, never split.
    return None if lr is None else float(np.asarray(lr.addressable_data(0)))

  def write_summary(self, out: str, summary: dict[str, Any]) -> None:
    """Writes OUT/summary.json on process 0 (what `hetjax report` reads)."""
    run_common.write_summary(out, summary, self.host_id)

  def close(self) -> None:
    """Stops the input threads and finishes any checkpoint being written."""
    self.loader.close()
    self._clock.close()
    if self.checkpointer is not None:
      self.checkpointer.wait()
      self.checkpointer.close()

  def save_checkpoint(self, wait: bool = False) -> None:
    """Saves the state after `self.step` steps (every host must call it).

    The hosts' parameter fingerprints are compared first: a checkpoint never
    records replicas that diverged.
    """
    if self.checkpointer is None:
      raise ValueError("this trainer has no checkpoint folder; pass checkpoint=CheckpointConfig(...).")
    if self.checkpointer.last_saved != self.step:
      self.check_params_agree()
    if wait or not self.checkpointer.config.async_save:
      self.checkpointer.save(self.step, self._global_state(), self._checkpoint_meta())
      if wait:
        self.checkpointer.wait()
    else:  # A device copy; a worker thread hands it to orbax while training goes on.
      self.checkpointer.save_in_background(self.step, self._settled_state(),
                                           self._checkpoint_meta(), self.meshes.world)

  def _final_waits(self) -> None:
    """The compute and wait seconds no step's rows carried yet travel in one small collective."""
    self._drain()
    h = self.history
    missing = range(h.dropped + len(h.compute_s), h.steps)  # At most the last two steps.
    if missing:  # Every host misses the same steps.
      mine = [x for i in missing for x in self._timings.get(self._start_step + i, (0.0, 0.0))]
      # Always four values: one compiled gather, however many steps are missing.
      rows = mesh_lib.gather_host_values(np.array(mine + [0.0] * (4 - len(mine))), self.meshes)
      for k in range(len(missing)):
        h.compute_s.append([float(r) for r in rows[:, 2 * k]])
        h.wait_s.append([float(r) for r in rows[:, 2 * k + 1]])

  def summary(self, digest: bool = False) -> dict[str, Any]:
    """The figures of the run so far; identical on every host.

    Aggregates cover the whole run; the per-host lists (`batch`, `compute_s`,
    `wait_s`) only the recent steps the history keeps (`hetjax.observe.history.WINDOW`):
    every step is in metrics.jsonl.

    Args:
      digest: also hash every parameter (`params_digest`): a copy of the
        whole model to host memory, so only on request.
    """
    self._final_waits()
    h = self.history
    steady, steady_s, busy_compute, busy_wait = h.steady_totals(WARMUP_STEPS, self.num_hosts)
    samples_per_sec = self.config.global_batch * steady / steady_s if steady_s > 0 else 0.0
    per_host = []
    for i in range(self.num_hosts):
      busy = busy_compute[i] + busy_wait[i]
      per_host.append({"batch": [s[i] for s in h.shares], "compute_s": [c[i] for c in h.compute_s],
                       "wait_s": [w[i] for w in h.wait_s],
                       "idle_fraction": busy_wait[i] / busy if busy else 0.0})
    summary = run_common.summary_fields(
        steps=h.steps, last_step=self.step, resumed_from=self.resumed_from, config=self.config,
        meshes=self.meshes, balancer_mode=self.balancer.name,
        balancer_decisions=list(getattr(self.balancer, "decisions", [])),
        samples_per_sec=samples_per_sec, losses=h.loss, metrics=h.metrics,
        params_digest=params_digest(self.params()) if digest else None,
        evaluation=self._last_eval(), emulated=self.emulated, per_host=per_host)
    summary["memory_per_device"] = self.memory_per_device()
    return summary

  def memory_per_device(self) -> dict[str, Any]:
    """Bytes of parameters, optimizer state and gradients one device holds, from the
    arrays' sizes: `unsplit` (every device updating a whole replica) and, when the
    update is sharded, `split` over `split_over` devices (`hetjax.step.sharding`)."""
    if self._memory is None:  # Shapes are fixed for the run: computed once.
      if self.sharded is None:
        self._memory = {"split_over": 1, "where": "devices",
                        **sharding_lib.memory_per_device(self._live, 1)}
      else:
        where = "devices" if self.config.reduction == "device" else "host CPUs (one per host)"
        self._memory = {"split_over": self.sharded.size, "where": where,
                        **sharding_lib.memory_per_device(self.sharded.like, self.sharded.size,
                                                         self.optimizer)}
    return self._memory

  def params(self) -> PyTree:
    """The current parameters as host numpy arrays (this host's replica)."""
    return run_common.host_copy(self._replica().params)

  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]:
    """Mean loss and metrics over all of `source`; every host must call it.

    Compiled once (parameters are arguments); the split is streamed
    `batch_size` records per device at a time and spread over every host
    (slices sized by the current shares, i.e. by speed) and its devices.
    """
    self._evaluator = run_common.evaluator_for(self._evaluator, self.task, self.meshes, batch_size)
    weights = self.history.shares[-1] if self.history.shares else [1] * self.num_hosts
    state = self._replica()
    return self._evaluator.evaluate(state.params, state.model_state, source, weights)

  def _last_eval(self) -> dict[str, Any] | None:
    return run_common.last_eval(self.history.evals, self._start_step)


def train(task: Task, optimizer: optax.GradientTransformation, source: data_lib.ArraySource,
          *, global_batch: int, steps: int, **config: Any) -> tuple[Trainer, dict[str, Any]]:
  """One call: build a `Trainer` from keyword settings and run `steps` steps."""
  trainer = Trainer(task, optimizer, source, TrainConfig(global_batch=global_batch, **config))
  return trainer, trainer.fit(steps)
