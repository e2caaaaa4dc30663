"""`RoundsTrainer`: the loop of the rounds modes (hybrid, elastic).

One round, on every host (DESIGN "Modes: one lockstep rule"):
taus (same on every host) -> the round's positions -> this host's `tau_i`
local steps on its own devices -> (emulated pacing) -> the mode's
contribution -> the one reduction, which also carries every host's timings
and its stop flag -> the mode's finish (outer update / elastic move).

`--steps` counts rounds; `global_batch` is the samples of one round step of
every host (each local step of a host takes `global_batch / hosts` unless
`local_batch` is set).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.training import agreement
from hetjax.input import augment as augment_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.input import data as data_lib
from hetjax.training import lifecycle
from hetjax.cluster import signals
from hetjax.cluster import watchdog
from hetjax import mesh as mesh_lib
from hetjax import step as step_lib
from hetjax.step import device_batch as device_batch_lib
from hetjax import task as task_lib
from hetjax.observe.history import History
from hetjax.modes import elastic as elastic_lib
from hetjax.modes import hybrid as hybrid_lib
from hetjax.modes import rounds as rounds_lib
from hetjax.modes.options import RoundsConfig
from hetjax.task import Task

PyTree = Any
WARMUP_ROUNDS = rounds_lib.WARMUP_ROUNDS
# The host vector of the reduction: seconds per local step, the round's
# local compute seconds, and, of the round before (known only after its
# reduction), the reduction's seconds and the host's distance to the hosts'
# mean; then the stop flag.
_STEP_S, _COMPUTE_S, _WAIT_S, _SPREAD, _STOP = range(5)


class Saved(NamedTuple):
  """What a checkpoint holds: the centre, and each host's inner state with a leading row per device.

  Orbax saves global arrays only, so a host's own state travels as rows of
  `[all devices, ...]` arrays (every device row of host h holds host h's).
  """

  round: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree
  host_params: PyTree
  host_opt_state: PyTree
  host_model_state: PyTree


class RoundsTrainer:
  """Hybrid or elastic training over whatever hosts this process belongs to.

  Example:
    >>> hetjax.initialize()
    >>> trainer = RoundsTrainer(task, optax.sgd(0.1), source,
    ...                         hetjax.TrainConfig(global_batch=96),
    ...                         RoundsConfig(mode="hybrid", round_steps=4))
    >>> summary = trainer.fit(until=50)   # 50 rounds
  """

  def __init__(self, task: Task, optimizer: optax.GradientTransformation,
               source: data_lib.ArraySource, config: Any, rounds: RoundsConfig, *,
               pace: Callable[..., float] | None = None, identity: str = "",
               checkpoint: ckpt_lib.CheckpointConfig | None = None):
    """Validates everything, agrees with the other hosts, then initialises.

    Args:
      task: the model.
      optimizer: the inner optax optimizer (its state stays on each host).
      source: random-access records.
      config: a `hetjax.TrainConfig` (global batch, micro-batch, seed,
        reduction backend, augmentation, device batch; `assignment`/`balancer` do not
        apply).
      rounds: the mode and its settings.
      pace: emulation hook, as for `hetjax.Trainer`.
      identity: extra text the hosts must agree on.
      checkpoint: where and how often (in rounds) to save; resumes by default.
    """
    lifecycle.check_joined("a trainer")
    config.validate()
    if config.balancer is not None or config.assignment != "equal":
      raise ValueError(f"--mode {rounds.mode} sizes the hosts' work by local steps; the "
                       "assignment and balancer settings do not apply (use --local-steps).")
    self.meshes = mesh_lib.Meshes.create()
    self.host_id, self.num_hosts = self.meshes.host_id, self.meshes.num_hosts
    rounds.validate(self.num_hosts, config.global_batch)
    if checkpoint is not None:
      checkpoint.validate()
    self.task, self.source, self.config, self.rounds = task, source, config, rounds
    self.local_batch = rounds.local_batch_for(config.global_batch, self.num_hosts)
    self.sampler = data_lib.GlobalSampler(len(source), config.global_batch, config.seed,
                                          name=source.info.name)
    agreement.agree_on(f"{config!r}|{rounds!r}|{source.info!r}|{len(source)}|{identity}|"
                       f"{checkpoint!r}", self.meshes, what="configuration", fix="(config hash "
                       "mismatch): every host must run the same command and arguments.")
    self.emulated, self.pace = lifecycle.pacing(pace, self.host_id)
    self.augment = augment_lib.parse(config.augment)
    example = source[np.arange(1)]
    task_lib.check_batch_keys(list(example))
    block = next(step_lib.micro_batches(example, config.microbatch))
    init = jax.jit(task.init, out_shardings=self.meshes.replicated)
    params, model_state = init(jax.random.key(config.seed), block)
    lifecycle.check_task(task, params, model_state, block, eval_loss=False)
    if rounds.mode == "hybrid":
      outer = hybrid_lib.outer_optimizer(rounds.outer_optimizer, rounds.outer_lr,
                                         rounds.outer_momentum)
      self.mode = hybrid_lib.Hybrid(outer, self.meshes)
    else:
      self.mode = elastic_lib.Elastic(rounds.elastic_beta, self.meshes)
    self.centre = self.mode.init_centre(params, model_state)
    # Each host's blocks per device at once (issue 27); the math does not change.
    self.device_batches = device_batch_lib.for_hosts(config, task, params, model_state, example,
                                                     self.meshes, samples=self.local_batch)
    lifecycle.warn_fast_variance(task, params, model_state, block, self.device_batches,
                                 self.host_id)
    self.local = rounds_lib.LocalStep(task, optimizer, self.meshes, config.microbatch,
                                      self.local_batch, config.precision,
                                      self.device_batches[self.host_id])
    self.host_params, self.host_model_state = None, None
    self.host_opt_state = self.local.init_opt_state(rounds_lib.to_host_mesh(params, self.meshes))
    self.reduction = rounds_lib.RoundReduction(config.reduction, self.meshes)
    self.taus = rounds_lib.TauPolicy(rounds.round_steps, self.num_hosts, rounds.local_steps)
    # A round is the history's step: shares are the samples each host processed.
    self.history = History(series={"tau": [], "spread": []})  # spread: ||x_i - mean||
    self.position = 0          # The data cursor: next position of the global stream.
    self._start_round = 0
    self._base_key = jax.random.key(config.seed)
    self._last_wait = self._last_spread = 0.0
    self._stop_code = 0.0  # The largest stop signal any host sent (hetjax.cluster.signals).
    self._evaluations = lifecycle.Evaluations(task, self.meshes)
    self.resumed_from: int | None = None
    self.job = ckpt_lib.describe_job(self.centre, {
        "mode": rounds.mode, "global_batch": config.global_batch, "seed": config.seed,
        "dataset": repr(source.info), "num_records": len(source), "identity": identity,
        "rounds": repr(dataclasses.replace(rounds, local_steps=None))})
    self.checkpointer = lifecycle.checkpointer(checkpoint, self.meshes)
    if checkpoint is not None and checkpoint.resume:
      self._resume()

  # ---- one round ----------------------------------------------------------

  @property
  def round(self) -> int:
    """The index of the next round to run."""
    return self._start_round + self.history.steps

  @property
  def step(self) -> int:
    return self.round

  @property
  def start_step(self) -> int:
    """The round this trainer started from: 0, or the checkpoint's it resumed."""
    return self._start_round

  @property
  def state(self) -> hybrid_lib.Centre:
    """The centre (what is evaluated and reported)."""
    return self.centre

  def train_round(self) -> dict[str, float]:
    """Runs one round on every host; returns the round's global metrics."""
    r, me, b = self.round, self.host_id, self.local_batch
    watchdog.entered(r)
    taus = self.taus.taus(r)
    plan = rounds_lib.RoundData(self.position, taus, b, self.config.microbatch)
    n = plan.samples()
    total_n = sum(n)
    t0 = time.perf_counter()
    params, model_state = self.mode.start(self.centre, self.host_params, self.host_model_state)
    opt_state = self.host_opt_state
    batch = rounds_lib.read(self.source, self.sampler, plan.host_positions(me), self.augment)
    totals = None
    for k in range(taus[me]):
      part = {key: v[k * b:(k + 1) * b] for key, v in batch.items()}
      params, opt_state, model_state, stats = self.local(
          params, opt_state, model_state, part, self._base_key, r, plan.first_block(me, k))
      totals = stats if totals is None else jax.tree.map(jnp.add, totals, stats)
    contribution = self.mode.contribution(self.centre, params, model_state, n[me], total_n)
    jax.block_until_ready(contribution)
    compute = time.perf_counter() - t0
    if self.pace is not None:
      padded = self.local.micro_rounds * self.meshes.local_devices * self.config.microbatch
      compute = self.pace(compute, r, taus[me] * padded)
    t1 = time.perf_counter()
    host_values = np.array([compute / taus[me], compute, self._last_wait, self._last_spread,
                            signals.REQUESTS.code])
    watchdog.reducing(r)
    reduced, rows = self.reduction({"update": contribution, "stats": totals}, host_values)
    watchdog.completed(r)
    spread = self.mode.spread(contribution, reduced["update"], n[me], total_n)
    self.centre, params = self.mode.finish(self.centre, reduced["update"], params, total_n)
    self.host_params, self.host_opt_state, self.host_model_state = params, opt_state, model_state
    stats = jax.device_get(reduced["stats"])
    t2 = time.perf_counter()
    self._last_wait, self._last_spread = t2 - t1, float(spread)
    self._stop_code = float(rows[:, _STOP].max())
    self.taus.observe(r, rows[:, _STEP_S].tolist())
    self.position += plan.size
    weight = float(stats["weight"]) or 1.0
    metrics = {"loss": float(stats["loss"]) / weight,
               **{k: float(v) / weight for k, v in stats["metrics"].items()}}
    if "skipped" in stats:  # fp16: local steps skipped for overflow, over every host.
      metrics["skipped"] = float(stats["skipped"])
    h = self.history
    h.shares.append(n)
    h.series["tau"].append(taus)
    h.compute_s.append(rows[:, _COMPUTE_S].tolist())
    if h.dropped + len(h.wait_s) < h.steps - 1:  # The round before's, now that every host sent them.
      h.wait_s.append(rows[:, _WAIT_S].tolist())
      h.series["spread"].append(rows[:, _SPREAD].tolist())
    h.step_s.append(t2 - t0)
    h.loss.append(metrics["loss"])
    h.metrics.append(metrics)
    return metrics

  # ---- records ------------------------------------------------------------

  def _round_metrics(self, k: int) -> dict[str, float]:
    """A record's own figures of the round in window entry `k`: each host's tau and
    distance to the hosts' mean, and the reduction's seconds (the least wait)."""
    h, metrics = self.history, {}
    for host in range(self.num_hosts):
      metrics[f"tau/{host}"] = float(h.series["tau"][k][host])
      metrics[f"spread/{host}"] = float(h.series["spread"][k][host])
    metrics["reduction_s"] = float(min(h.wait_s[k]))
    return metrics

  def _final_waits(self) -> None:
    """The last round's reduction seconds and spreads travel in one extra small collective."""
    h = self.history
    if h.dropped + len(h.wait_s) < h.steps:
      rows = mesh_lib.gather_host_values(np.array([self._last_wait, self._last_spread]),
                                         self.meshes)
      h.wait_s.append([float(r) for r in rows[:, 0]])
      h.series["spread"].append([float(r) for r in rows[:, 1]])

  # ---- the loop -------------------------------------------------------------

  def fit(self, rounds: int | None = None, *, until: int | None = None, log_every: int = 0,
          log: Callable[[str], None] = print,
          on_round: Callable[["RoundsTrainer", dict[str, float]], None] | None = None,
          on_step: Callable[["RoundsTrainer", dict[str, float]], None] | None = None,
          sinks: Sequence[Callable[[dict[str, Any]], Any]] = (), eval_every: int = 0,
          eval_source: data_lib.ArraySource | None = None, out: str | None = None) -> dict[str, Any]:
    """Runs `rounds` more rounds, or until round `until`; returns the summary (same on every host).

    The arguments are `hetjax.Trainer.fit`'s, in rounds (`on_step` is an
    alias of `on_round`): callbacks and evaluations run after a round,
    outside its clock, and a stop signal to any host makes every host stop
    at the next round boundary (saving first when there is a checkpoint folder).
    A round's record is the metrics schema's step: shares are the samples
    each host processed, and `metrics` carries `tau/<host>`,
    `spread/<host>` and `reduction_s`.
    """
    callback = on_round or on_step
    with lifecycle.Run(self, rounds, until=until, unit="rounds", warmup=WARMUP_ROUNDS,
                       log_every=log_every, log=log, sinks=sinks, eval_every=eval_every,
                       eval_source=eval_source, out=out, extra=self._round_metrics) as run:
      with run.watching():
        while self.round < run.target:
          metrics = self.train_round()
          if run.evaluation_due(self.round):
            run.evaluate()
          run.record()
          if callback is not None:
            callback(self, metrics)
          if self._stop_code:
            code, self._stop_code = self._stop_code, 0.0
            run.stop(code)
          if self.config.check_every and self.round % self.config.check_every == 0:
            self.check_centre_agrees()
          if self.checkpointer is not None and self.round % self.checkpointer.config.every == 0:
            self.save_checkpoint()
      run.evaluate_at_end()
      return run.close()

  def write_summary(self, out: str, summary: dict[str, Any]) -> None:
    """Writes OUT/summary.json on process 0 (what `hetjax report` reads)."""
    lifecycle.write_summary(out, summary, self.host_id)

  def summary(self, digest: bool = False) -> dict[str, Any]:
    """The figures of the run so far; identical on every host (`digest`: hash the centre too)."""
    self._final_waits()
    taus = "from speeds" if self.rounds.local_steps is None else "fixed (--local-steps)"
    return {"mode": self.rounds.mode, "local_batch": self.local_batch,
            "data_position": self.position, **lifecycle.summary(
                self, warmup=WARMUP_ROUNDS, balancer_mode=f"{self.rounds.mode} rounds, taus {taus}",
                balancer_decisions=[], per_host=self.history.per_host(self.num_hosts), digest=digest),
            "device_batches": list(self.device_batches)}

  def params(self) -> PyTree:
    """The centre's parameters as host numpy arrays."""
    return lifecycle.host_copy(self.centre.params)

  def evaluate(self, source: data_lib.ArraySource, batch_size: int = 256) -> dict[str, float]:
    """Mean loss and metrics of the centre over all of `source`; every host must call it.

    Spread over the hosts by the samples they processed last round (their speed).
    """
    weights = self.history.shares[-1] if self.history.shares else [1] * self.num_hosts
    return self._evaluations.evaluate(self.centre.params, self.centre.model_state, source,
                                      weights, batch_size)

  def close(self) -> None:
    if self.checkpointer is not None:
      self.checkpointer.wait()
      self.checkpointer.close()

  # ---- checkpoints ------------------------------------------------------------

  def check_centre_agrees(self) -> None:
    """Compares every host's fingerprint of the centre and outer state (every host must call it).

    Each slice of the centre's update is computed by one device and
    gathered (`hetjax.step.sharding`), so rounding cannot make hosts differ;
    this catches a real fault (other code, a damaged copy) every
    `check_every` rounds and before each checkpoint. The hosts' own
    parameters differ by design (elastic) and are not compared.

    Raises:
      agreement.HostsDisagree: naming the hosts whose centre differs.
    """
    local = jax.tree.map(lambda x: mesh_lib.to_local(x, self.meshes), self.centre)
    agreement.check_replicas(self.round, local, self.meshes,
                             what="centres (parameters, outer state)")

  def _layout(self) -> dict[str, Any]:
    return lifecycle.layout(self.meshes, self.config.microbatch)

  def _rows(self, tree: PyTree) -> PyTree:
    """This host's arrays as its rows of `[all devices, ...]` global arrays."""
    d = self.meshes.local_devices
    spread = jax.jit(lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (d,) + x.shape), t),
                     out_shardings=self.meshes.local_by_device)
    return jax.tree.map(lambda x: mesh_lib.to_world(x, self.meshes), spread(tree))

  def _saved(self) -> Saved:
    params, model_state = self.mode.start(self.centre, self.host_params, self.host_model_state)
    c = self.centre
    return Saved(c.round, c.params, c.opt_state, c.model_state, self._rows(params),
                 self._rows(self.host_opt_state), self._rows(model_state))

  def save_checkpoint(self, wait: bool = False) -> None:
    """Saves the state after `self.round` rounds (every host must call it)."""
    if self.checkpointer is None:
      raise ValueError("this trainer has no checkpoint folder; pass checkpoint=CheckpointConfig(...).")
    if self.checkpointer.last_saved != self.round:
      self.check_centre_agrees()
    meta = {"job": self.job, "layout": self._layout(), "position": self.position,
            "round": self.round, "taus": self.taus.state_dict(),
            "device_batches": list(self.device_batches)}
    self.checkpointer.save(self.round, self._saved(), meta)
    if wait:
      self.checkpointer.wait()

  def _resume(self) -> None:
    """Continues from the newest complete checkpoint written on this layout.

    On another layout the per-host rows do not fit: the centre and the outer
    state are restored, and every host's inner state restarts from the centre.
    """
    newest = self.checkpointer.complete_steps()
    if not newest:
      return
    # The saved layout decides the shape of the per-host rows: on another
    # layout they are read replicated and dropped (private read of the meta:
    # the Checkpointer restores whole states only).
    peek = self.checkpointer._read_meta(newest[0])  # pylint: disable=protected-access
    like = self._saved()
    if peek is not None and peek.get("layout") != self._layout():
      rows = sum(peek["layout"]["devices_per_host"])
      as_saved = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          (rows,) + x.shape[1:], x.dtype, sharding=self.meshes.replicated), t)
      like = like._replace(host_params=as_saved(like.host_params),
                           host_opt_state=as_saved(like.host_opt_state),
                           host_model_state=as_saved(like.host_model_state))
    restored = self.checkpointer.restore_latest(like, self.job)
    if restored is None:
      return
    saved, meta = restored
    same_layout = meta["layout"] == self._layout()
    self.centre = hybrid_lib.Centre(saved.round, saved.params, saved.opt_state, saved.model_state)
    if same_layout:
      self.host_params = self._own_rows(saved.host_params)
      self.host_opt_state = self._own_rows(saved.host_opt_state)
      self.host_model_state = self._own_rows(saved.host_model_state)
      self.taus.load_state_dict(meta.get("taus", {}))
    else:
      self.host_params = self.host_model_state = None  # The mode starts them at the centre.
      self.host_opt_state = self.local.init_opt_state(
          rounds_lib.to_host_mesh(self.centre.params, self.meshes))
    self.position = int(meta["position"])
    self._start_round = self.resumed_from = int(meta["round"])
    if self.host_id == 0:
      print(f"hetjax: resumed {self.rounds.mode} from {self.checkpointer.directory}/"
            f"{self._start_round} (written by {meta['layout']['hosts']} host(s) x "
            f"{meta['layout']['devices_per_host']} device(s))"
            + ("" if same_layout else "; another layout: every host's inner state restarts "
               "from the centre"), flush=True)

  def _own_rows(self, tree: PyTree) -> PyTree:
    """This host's state back from its rows: device row j holds the same copy."""
    def own(x):
      shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
      local = [s.data.reshape(s.data.shape[1:]) for s in shards]
      return jax.make_array_from_single_device_arrays(
          x.shape[1:], self.meshes.local_replicated, local)
    return jax.tree.map(own, tree)
