"""The sync step pipeline: dispatch step s, finish step s - 1, feed the balancer.

One step is docs/design.md's "One step, as the data flows". Consecutive steps
overlap ("Overlapped steps"): a step's statistics are fetched after the next is
dispatched, so the devices never wait for Python.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np

from hetjax import balancer as balancer_lib
from hetjax import blocks as blocks_lib
from hetjax import mesh as mesh_lib
from hetjax import step as step_lib
from hetjax.cluster import signals
from hetjax.cluster import watchdog
from hetjax.input import loader as loader_lib
from hetjax.observe.history import History
from hetjax.training import agreement
from hetjax.training import readiness
from hetjax.training.host_vector import HostVector
from hetjax.training.replica import Replica

# What each host adds to a sync step's reduction: its compute, wait and input-wait
# seconds of step `s - 2`, its stop request, and the shares it used.
HOST_VECTOR = HostVector("compute_s", "wait_s", "input_s", "stop", per_host="shares")
# The seconds no step carried yet, in `final_waits`' one small collective:
# (compute, wait, input) of the last two steps (zeros where fewer are missing).
FINAL_WAITS = HostVector("compute_s", "wait_s", "input_s", "compute_s_1", "wait_s_1", "input_s_1")
TIMINGS = ("compute_s", "wait_s", "input_s")


def default_balancer(config: Any, meshes: mesh_lib.Meshes, device_batches: Any,
                     start_step: int = 0) -> balancer_lib.Balancer:
  """The configured policy, deciding in blocks (one device round = granularity)."""
  options = {"start_step": start_step} if config.balancer in ("static", "dynamic") else {}
  return blocks_lib.make_block_balancer(
      config.assignment, config.global_batch, config.microbatch,
      meshes.devices_per_host(), mode=config.balancer,
      device_batches=device_batches, **options)


class _InFlight(NamedTuple):
  """A step whose programs are dispatched and whose results are not yet fetched."""

  step: int
  shares: tuple[int, ...]
  t0: float                          # when its dispatch began
  fed: float                         # when the loader handed over its batch
  t1: float                          # when its local programs were dispatched (and paced)
  ready: readiness.Pending | None    # when its local sums, then its update, were ready
  paced: float | None                # emulated compute seconds (emulation only)
  reduced: step_lib.Reduced


class StepPipeline:
  """Runs sync steps on this host, at most one in flight, and records them in `history`.

  The rows of step `s` carry every host's seconds of step `s - 2` and stop request, so the
  balancer and the stop follow the same figures at the same step on every host (invariant 3).
  """

  def __init__(self, config: Any, meshes: mesh_lib.Meshes, replica: Replica,
               reduction: Any, loader: loader_lib.HostLoader, example: dict[str, np.ndarray],
               balancer: balancer_lib.Balancer, history: History,
               pace: Callable[[float, int, int], float] | None):
    self.config, self.meshes, self.replica, self.reduction = config, meshes, replica, reduction
    self.loader, self.example, self.balancer, self.history = loader, example, balancer, history
    self.pace = pace
    self.base_key = jax.random.key(config.seed)
    self.start_step = 0  # The step this trainer started from (a resumed one's checkpoint).
    # XLA:CPU's "devices" are the loop's own cores: stamped where the loop looks.
    self.clock = readiness.ReadyClock(on_loop=meshes.local.devices.flat[0].platform == "cpu")
    self.flight: _InFlight | None = None  # The step dispatched but not yet fetched.
    self._timings: dict[int, tuple[float, ...]] = {}  # step -> this host's TIMINGS
    self._shares_of: dict[int, tuple[int, ...]] = {}    # step -> shares, for the balancer
    self._observations: list[tuple[int, int, list[float]]] = []  # (from step, step, compute)
    self._last_update_ready: float | None = None
    self._stop_code = 0.0  # The largest stop signal any host sent (hetjax.cluster.signals).
    self._stop_at: int | None = None  # The step boundary where every host acts on it.

  @property
  def step(self) -> int:
    """The index of the next step to run (a dispatched step counts as run)."""
    return self.start_step + self.history.steps + (self.flight is not None)

  def boundaries(self, target: int, due: Callable[[int], bool],
                 finished: Callable[[], None]) -> Iterator[tuple[int, dict[str, float] | None]]:
    """Runs the steps up to `target`, each dispatched before the one before is finished.

    Yields (step, the last step's metrics), nothing in flight, where `due(step)`, a stop or
    the target says; calls `finished()` after every step. An error finishes the flight first.
    """
    self.drain()  # A step an earlier call left in flight.
    while self.step < target:
      try:
        previous, self.flight = self.flight, self.dispatch()
        if previous is not None:  # Fetched now that the next step keeps the devices busy.
          self.finish(previous)
          finished()
        step = self.step
        if not (step >= target or self.stopping() or due(step)):
          continue
        metrics = self.drain()
      except Exception:
        self.settle_after_error()
        raise
      yield step, metrics

  def drain(self) -> dict[str, float] | None:
    """Finishes the step in flight, if any; its metrics."""
    flight, self.flight = self.flight, None
    return None if flight is None else self.finish(flight)

  def settle_after_error(self) -> None:
    """Finishes the step in flight (its update happened on every host), so the trainer's
    step matches its state; its own error is dropped: the first one is raised."""
    try:
      self.drain()
    except Exception:  # noqa: BLE001 (reported through the error being raised)
      pass

  def stopping(self) -> bool:
    """Whether every host has reached the boundary where it acts on a stop request."""
    return self._stop_at is not None and self.step >= self._stop_at

  def take_stop(self) -> float:
    """The stop request's code, acted on now (cleared); the last update applied first."""
    code, self._stop_code, self._stop_at = self._stop_code, 0.0, None
    self.settle_update()
    return code

  def dispatch(self) -> _InFlight:
    """Launches one step (local programs, then the reduction) without waiting for it; the
    balancer decides step `s` from rows up to step `s - 2`."""
    step, config, replica = self.step, self.config, self.replica
    watchdog.entered(step)
    t0 = time.perf_counter()
    self._look_at_last_step()
    self._feed_balancer(step)
    block = config.microbatch
    shares = blocks_lib.check_aligned(balancer_lib.validate_shares(
        self.balancer.shares(step), config.global_batch, self.meshes.num_hosts),
        config.global_batch, block)
    self._shares_of[step] = shares
    batch = self.loader.get(step, shares)
    fed = time.perf_counter()
    self.loader.prefetch(step + 1, shares)  # A guess: shares rarely change.
    timings = dict(zip(TIMINGS, self._timings.pop(step - 2, (0.0,) * len(TIMINGS))))
    host_values = HOST_VECTOR.pack(**timings, stop=signals.REQUESTS.code, shares=shares)
    self._look_at_last_step()
    live, applied, pending = replica.take()
    local = replica.local(live, pending, batch, self.example, self.base_key, step,
                          blocks_lib.first_block(shares, self.meshes.host_id, block), host_values)
    replica.stepped(local, applied)
    paced = None
    if self.pace is not None:
      jax.block_until_ready(local.sums)
      unit = config.microbatch * self.meshes.local_devices
      # Paced steps are finished one by one: the devices were idle at t0.
      paced = self.pace(time.perf_counter() - t0, step,
                        -(-shares[self.meshes.host_id] // unit) * unit)
    t1 = time.perf_counter()
    watchdog.reducing(step)
    reduced = self.reduction(local.sums, replica.shards)  # Sharded: the update runs in it.
    replica.reduced(step, reduced)
    ready = None
    if self.pace is None:
      ready = self.clock.defer(local.sums, reduced.report)
      # The step before first, so that stamps taken on the loop never run backwards.
      self._look_at_last_step()
      ready.look()
    return _InFlight(step, shares, t0, fed, t1, ready, paced, reduced)

  def _look_at_last_step(self) -> None:
    """Stamps the step in flight's stages done by now (on XLA:CPU; else a no-op)."""
    if self.flight is not None and self.flight.ready is not None:
      self.flight.ready.look()

  def finish(self, flight: _InFlight) -> dict[str, float]:
    """Fetches a dispatched step's statistics and rows; records and checks them."""
    stats, rows = flight.reduced.fetch()
    watchdog.completed(flight.step)
    fetched = time.perf_counter()
    step, shares = flight.step, flight.shares
    code = float(HOST_VECTOR.column(rows, "stop").max())
    if code and self._stop_at is None:
      # Acted on two steps later: by then every host has this row, whether
      # or not its loop overlaps steps.
      self._stop_code, self._stop_at = code, step + 2
    if self.pace is None:
      local_ready, update_ready = flight.ready.result()
      # The devices start a step when the previous update is done, or when it is dispatched:
      # a loader that hands the batch over later makes the host look slower to the
      # balancer (it is), and the goodput calls that part waiting for input.
      busy_from = max(flight.t0, self._last_update_ready or flight.t0)
      starved = max(0.0, min(flight.fed, local_ready) - busy_from)
      self._timings[step] = (local_ready - busy_from, update_ready - local_ready, starved)
    else:
      update_ready = fetched
      self._timings[step] = (flight.paced, fetched - flight.t1, flight.fed - flight.t0)
    self._last_update_ready = update_ready
    metrics = {k: float(v) for k, v in stats.items() if k != "count"}
    self.history.record(shares, fetched - flight.t0, metrics["loss"], metrics)
    timed = step - 2
    if timed >= self.start_step:  # Every host's compute and wait seconds of step s - 2.
      compute = HOST_VECTOR.column(rows, "compute_s")
      self.history.arrived(timed - self.start_step, compute_s=compute,
                           wait_s=HOST_VECTOR.column(rows, "wait_s"),
                           input_s=HOST_VECTOR.column(rows, "input_s"))
      self._observations.append((step, timed, compute.tolist()))
    self.read_learning_rates(before=step)
    # Checked once recorded: the update has happened, whatever the check says.
    agreement.check_shares(step, HOST_VECTOR.per_host(rows))
    if stats["count"] <= 0:
      raise RuntimeError(f"step {step}: the hosts processed 0 examples in total; the "
                         f"assignment {shares} must give the global batch at least one sample.")
    return metrics

  def _feed_balancer(self, step: int) -> None:
    """Gives the balancer the figures that arrived with steps up to `step - 2`."""
    while self._observations and self._observations[0][0] <= step - 2:
      _, timed, compute = self._observations.pop(0)
      self.balancer.observe(timed, self._shares_of[timed], compute)
    for old in [s for s in self._shares_of if s < step - 4]:
      del self._shares_of[old]

  def read_learning_rates(self, before: int | None = None) -> None:
    """Records the learning rate of every applied update of a step before `before`."""
    for s, lr in self.replica.learning_rates(before).items():
      index = s - self.start_step
      if index >= self.history.dropped:
        self.history.lr[index] = lr

  def settle_update(self) -> None:
    """Applies the last update and reads every learning rate due: every host, same step."""
    self.replica.apply_pending()
    self.read_learning_rates()

  def final_waits(self) -> None:
    """The compute and wait seconds no step's rows carried yet travel in one small collective."""
    self.drain()
    missing = self.history.awaiting  # At most the last two steps, the same on every host.
    if missing:
      mine = [x for i in missing
              for x in self._timings.get(self.start_step + i, (0.0,) * len(TIMINGS))]
      # Always six values: one compiled gather, however many steps are missing.
      mine += [0.0] * (len(FINAL_WAITS.names) - len(mine))
      rows = mesh_lib.gather_host_values(FINAL_WAITS.pack(**dict(zip(FINAL_WAITS.names, mine))),
                                         self.meshes)
      for k, index in enumerate(missing):
        suffix = "_1" if k else ""
        self.history.arrived(index, **{name: FINAL_WAITS.column(rows, name + suffix)
                                       for name in TIMINGS})

  def close(self) -> None:
    self.clock.close()
