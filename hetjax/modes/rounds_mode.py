"""The strategy hybrid and elastic share: one round, its records and its checkpoints.

A round (DESIGN "Modes: one lockstep rule"): taus -> this host's `tau_i` local
steps on its own devices -> the mode's contribution -> the one reduction (which
carries every host's timings and stop request) -> the mode's finish. A round is
the Trainer's step; a local step takes `global_batch / hosts` samples unless
`local_batch` is set.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from hetjax import mesh as mesh_lib
from hetjax import task as task_lib
from hetjax.checkpoint import manager as ckpt_lib
from hetjax.cluster import signals
from hetjax.cluster import watchdog
from hetjax.config import RoundsConfig
from hetjax.input import augment as augment_lib
from hetjax.modes import rounds as rounds_lib
from hetjax.modes.base import Boundary, Loop, ModeBase, Resumed, Setup
from hetjax.training.host_vector import HostVector

PyTree = Any
# Each host's seconds per local step and compute seconds, of the round before (known
# after its reduction) its reduction seconds and distance to the mean, and its stop request.
HOST_VECTOR = HostVector("step_s", "compute_s", "wait_s", "spread", "stop")
# The last round's reduction seconds and spread, in `summary_fields`' small collective.
FINAL_WAITS = HostVector("wait_s", "spread")


class Saved(NamedTuple):
  """What a checkpoint holds: the centre, and each host's inner state as rows of
  `[all devices, ...]` global arrays (orbax saves global arrays only)."""

  round: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree
  host_params: PyTree
  host_opt_state: PyTree
  host_model_state: PyTree


class Rounds(ModeBase):
  """A rounds mode: local steps on each host, one reduction per round. Subclasses say
  how a round ends: `compile` (which makes `_init`, the centre from the first parameters),
  `start`, `contribution`, `spread`, `finish`."""

  unit, warmup, series = "rounds", rounds_lib.WARMUP_ROUNDS, ("tau", "spread")

  def __init__(self, settings: RoundsConfig):
    settings.validate()  # The rest (local_steps per host, the split) when the hosts are known.
    self.settings = settings
    self.name = settings.mode

  def __repr__(self) -> str:
    return repr(self.settings)

  def build(self, setup: Setup) -> tuple[PyTree, dict[str, Any]]:
    config, meshes, s = setup.config, setup.meshes, self.settings
    s.check_split(config.balancer, config.assignment, config.shard_within_host)
    s.validate(meshes.num_hosts, config.global_batch)
    self.config, self.meshes, self.history, self.pace = config, meshes, setup.history, setup.pace
    self.source, self.sampler = setup.source, setup.sampler
    self.local_batch = s.local_batch_for(config.global_batch, meshes.num_hosts)
    self.augment = augment_lib.parse(config.augment)
    init = jax.jit(setup.task.init, out_shardings=meshes.replicated)
    params, model_state = init(jax.random.key(config.seed), setup.first_block)
    task_lib.check_partial_blocks(setup.task, model_state, self.local_batch, config.microbatch)
    setup.check_task(params, model_state, eval_loss=False)
    self.compile(meshes, backend=config.reduction)
    self.centre = self._init(params, model_state)
    setup.agree_on_model(self.centre)
    self.device_batches = setup.device_batches(params, model_state, samples=self.local_batch)
    setup.warn_fast_variance(params, model_state, self.device_batches)
    self.local = rounds_lib.LocalStep(setup.task, setup.optimizer, meshes, config.microbatch,
                                      self.local_batch, config.precision,
                                      self.device_batches[meshes.host_id])
    self.host_params, self.host_model_state = None, None
    self.host_opt_state = self.local.init_opt_state(rounds_lib.to_host_mesh(params, meshes))
    self.reduction = rounds_lib.RoundReduction(config.reduction, meshes)
    self.taus = rounds_lib.TauPolicy(s.round_steps, meshes.num_hosts, s.local_steps)
    self.position = 0          # The data cursor: next position of the global stream.
    self._start_round = 0
    self._base_key = jax.random.key(config.seed)
    self._last_wait = self._last_spread = 0.0
    return self.centre, {"mode": s.mode, "rounds": repr(dataclasses.replace(s, local_steps=None))}

  # ---- one round ----------------------------------------------------------

  @property
  def step(self) -> int:
    """The index of the next round to run."""
    return self._start_round + self.history.steps

  def advance(self, loop: Loop) -> Iterator[Boundary]:
    """Rounds up to `loop.target`; every round ends at a boundary (nothing is in flight)."""
    while self.step < loop.target:
      metrics, stop = self._round()
      yield Boundary(self.step, metrics, stop)

  def _round(self) -> tuple[dict[str, float], float]:
    """Runs one round on every host: its global metrics and the largest stop code sent."""
    r, me, b = self.step, self.meshes.host_id, self.local_batch
    watchdog.entered(r)
    taus = self.taus.taus(r)
    plan = rounds_lib.RoundData(self.position, taus, b, self.config.microbatch)
    n = plan.samples()
    total_n = sum(n)
    t0 = time.perf_counter()
    params, model_state = self.start(self.centre, self.host_params, self.host_model_state)
    opt_state = self.host_opt_state
    batch = rounds_lib.read(self.source, self.sampler, plan.host_positions(me), self.augment)
    totals = None
    for k in range(taus[me]):
      part = {key: v[k * b:(k + 1) * b] for key, v in batch.items()}
      params, opt_state, model_state, stats = self.local(
          params, opt_state, model_state, part, self._base_key, r, plan.first_block(me, k))
      totals = stats if totals is None else jax.tree.map(jnp.add, totals, stats)
    contribution = self.contribution(self.centre, params, model_state, n[me], total_n)
    jax.block_until_ready(contribution)
    compute = time.perf_counter() - t0
    if self.pace is not None:
      padded = self.local.micro_rounds * self.meshes.local_devices * self.config.microbatch
      compute = self.pace(compute, r, taus[me] * padded)
    t1 = time.perf_counter()
    host_values = HOST_VECTOR.pack(step_s=compute / taus[me], compute_s=compute,
                                   wait_s=self._last_wait, spread=self._last_spread,
                                   stop=signals.REQUESTS.code)
    watchdog.reducing(r)
    reduced, rows = self.reduction({"update": contribution, "stats": totals}, host_values)
    watchdog.completed(r)
    spread = self.spread(contribution, reduced["update"], n[me], total_n)
    self.centre, params = self.finish(self.centre, reduced["update"], params, total_n)
    self.host_params, self.host_opt_state, self.host_model_state = params, opt_state, model_state
    stats = jax.device_get(reduced["stats"])
    t2 = time.perf_counter()
    self._last_wait, self._last_spread = t2 - t1, float(spread)
    self.taus.observe(r, HOST_VECTOR.column(rows, "step_s").tolist())
    self.position += plan.size
    weight = float(stats["weight"]) or 1.0
    metrics = {"loss": float(stats["loss"]) / weight,
               **{k: float(v) / weight for k, v in stats["metrics"].items()}}
    if "skipped" in stats:  # fp16: local steps skipped for overflow, over every host.
      metrics["skipped"] = float(stats["skipped"])
    self.history.record(n, t2 - t0, metrics["loss"], metrics, tau=taus,
                        compute_s=HOST_VECTOR.column(rows, "compute_s"))
    # The round before's, now that every host sent them.
    self.history.arrived(self.history.steps - 2, wait_s=HOST_VECTOR.column(rows, "wait_s"),
                         spread=HOST_VECTOR.column(rows, "spread"))
    return metrics, float(HOST_VECTOR.column(rows, "stop").max())

  def record_metrics(self, k: int) -> dict[str, float]:
    """Each host's tau and distance to the hosts' mean in window entry `k`, and the
    reduction's seconds (the least wait)."""
    h = self.history
    return {**{f"{name}/{host}": float(h.series[name][k][host])
               for host in range(self.meshes.num_hosts) for name in ("tau", "spread")},
            "reduction_s": float(min(h.wait_s[k]))}

  # ---- the state ------------------------------------------------------------

  @property
  def state(self) -> PyTree:
    """The centre: what is evaluated, reported and checkpointed (global replicated arrays)."""
    return self.centre

  @state.setter
  def state(self, centre: PyTree) -> None:
    self.centre = centre

  def current(self) -> tuple[PyTree, PyTree]:
    return self.centre.params, self.centre.model_state

  def agreed(self) -> tuple[PyTree, str]:
    """The centre and outer state; the hosts' own parameters differ by design (elastic)."""
    return mesh_lib.to_local_tree(self.centre, self.meshes), "centres (parameters, outer state)"

  # ---- checkpoints ------------------------------------------------------------

  def meta(self) -> dict[str, Any]:
    return {"position": self.position, "round": self.step, "taus": self.taus.state_dict(),
            "device_batches": list(self.device_batches)}

  def saved(self, background: bool) -> tuple[PyTree, Mesh | None]:
    del background  # The centre is global already; the rows are copies.
    params, model_state = self.start(self.centre, self.host_params, self.host_model_state)
    c = self.centre
    return Saved(c.round, c.params, c.opt_state, c.model_state, self._rows(params),
                 self._rows(self.host_opt_state), self._rows(model_state)), None

  def restore(self, checkpointer: ckpt_lib.Checkpointer, job: dict[str, Any],
              layout: dict[str, Any]) -> Resumed | None:
    """The centre and outer state on any layout; each host's inner state on the same
    layout only (on another the rows do not fit: every host restarts from the centre)."""
    newest = checkpointer.complete_steps()
    if not newest:
      return None
    # The saved layout decides the shape of the per-host rows: on another
    # layout they are read replicated and dropped (private read of the meta:
    # the Checkpointer restores whole states only).
    peek = checkpointer._read_meta(newest[0])  # pylint: disable=protected-access
    like, _ = self.saved(background=False)
    if peek is not None and peek.get("layout") != layout:
      rows = sum(peek["layout"]["devices_per_host"])
      as_saved = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          (rows,) + x.shape[1:], x.dtype, sharding=self.meshes.replicated), t)
      like = like._replace(host_params=as_saved(like.host_params),
                           host_opt_state=as_saved(like.host_opt_state),
                           host_model_state=as_saved(like.host_model_state))
    restored = checkpointer.restore_latest(like, job)
    if restored is None:
      return None
    saved, meta = restored
    self.centre = type(self.centre)(saved.round, saved.params, saved.opt_state, saved.model_state)
    note = ""
    if meta["layout"] == layout:
      self.host_params = self._own_rows(saved.host_params)
      self.host_opt_state = self._own_rows(saved.host_opt_state)
      self.host_model_state = self._own_rows(saved.host_model_state)
      self.taus.load_state_dict(meta.get("taus", {}))
    else:
      self.host_params = self.host_model_state = None  # The mode starts them at the centre.
      self.host_opt_state = self.local.init_opt_state(
          rounds_lib.to_host_mesh(self.centre.params, self.meshes))
      note = "; another layout: every host's inner state restarts from the centre"
    self.position = int(meta["position"])
    self._start_round = int(meta["round"])
    return Resumed(self._start_round, meta, label=f"{self.name} ", note=note)

  def _rows(self, tree: PyTree) -> PyTree:
    """This host's arrays as its rows of `[all devices, ...]` global arrays."""
    d = self.meshes.local_devices
    spread = jax.jit(lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (d,) + x.shape), t),
                     out_shardings=self.meshes.local_by_device)
    return jax.tree.map(lambda x: mesh_lib.to_world(x, self.meshes), spread(tree))

  def _own_rows(self, tree: PyTree) -> PyTree:
    """This host's state back from its rows: device row j holds the same copy."""
    def own(x):
      shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
      local = [s.data.reshape(s.data.shape[1:]) for s in shards]
      return jax.make_array_from_single_device_arrays(
          x.shape[1:], self.meshes.local_replicated, local)
    return jax.tree.map(own, tree)

  # ---- the summary --------------------------------------------------------------

  def summary_fields(self) -> dict[str, Any]:
    """The mode's figures; first the last round's reduction seconds and spreads, in one
    small collective (no later round carries them)."""
    if self.history.awaiting:
      rows = mesh_lib.gather_host_values(
          FINAL_WAITS.pack(wait_s=self._last_wait, spread=self._last_spread), self.meshes)
      self.history.arrived(self.history.steps - 1, wait_s=FINAL_WAITS.column(rows, "wait_s"),
                           spread=FINAL_WAITS.column(rows, "spread"))
    s = self.settings
    taus = "from speeds" if s.local_steps is None else "fixed (local_steps)"
    return {"mode": s.mode, "local_batch": self.local_batch, "data_position": self.position,
            "balancer_mode": f"{s.mode} rounds, taus {taus}", "balancer_decisions": [],
            "device_batches": list(self.device_batches)}
