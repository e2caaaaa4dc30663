"""Entries for the sharded-update tests (`tests/test_sharded_update.py`), run on every host.

`mixed_compilers`: a tiny mlp trained with adam and a clipped global norm
while the hosts' compilers differ (the test gives host 1 other XLA flags);
each host returns whether every agreement check passed and its final
parameters.
"""

from __future__ import annotations

import numpy as np

import hetjax
# The models, batch, blocks and split of tests/_exact_entries.py, whose 3x2 run
# saves the checkpoints that `train_and_save` resumes.
from _exact_entries import BLOCK, GLOBAL_BATCH, SEED, UNEVEN, build, optimizer_memory  # noqa: F401
from hetjax import models as zoo
from hetjax import optimizers, trainer
from hetjax.input import data
from hetjax.training import agreement


BACKENDS = ("device", "host")


def mixed_compilers(steps: int, check_every: int, backends=BACKENDS):
  """Per backend: (the step an agreement check failed at or None, final params) on this host."""
  hetjax.initialize()
  source = data.load("digits")
  out = []
  for reduction in backends:
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
    optimizer = optimizers.make("adam", 0.003, clip_norm=1.0)
    config = trainer.TrainConfig(global_batch=32, microbatch=16, seed=0, reduction=reduction,
                                 check_every=check_every)
    tr = trainer.Trainer(task, optimizer, source, config)
    failed = None
    try:
      tr.fit(steps)
    except agreement.HostsDisagree:
      failed = tr.step
    out.append((failed, tr.params()))
    tr.close()
  return out


ROUND_MODES = (("hybrid", "device"), ("elastic", "host"))


def mixed_compilers_all(steps: int, check_every: int, rounds: int):
  """`mixed_compilers` on both backends, then each rounds mode's centre after `rounds` rounds."""
  from hetjax.config import RoundsConfig
  from hetjax.modes import from_config
  out = mixed_compilers(steps, check_every)
  source = data.load("digits")
  for mode, reduction in ROUND_MODES:
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
    config = trainer.TrainConfig(global_batch=32, microbatch=16, seed=0, reduction=reduction)
    tr = trainer.Trainer(task, optimizers.make("adam", 0.003, clip_norm=1.0), source, config,
                         mode=from_config(RoundsConfig(mode=mode, local_steps=(2, 2))))
    tr.fit(rounds)
    out.append((None, tr.params()))
    tr.close()
  return out, unsharded_loop(steps)


def unsharded_loop(steps: int):
  """The negative control: the same mlp, optimizer and batches trained by a plain
  `jax.jit` loop on this host alone (each host updating its own replica, as before
  the sharded update); returns the final parameters, which the hosts' compilers
  make differ."""
  import jax
  import optax
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
  source = data.load("digits")
  from hetjax.task import MASK
  batch = {**source[np.arange(32)], MASK: np.ones(32, np.float32)}
  optimizer = optimizers.make("adam", 0.003, clip_norm=1.0)
  params, model_state = task.init(jax.random.key(0), batch)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, i):
    def loss(p):
      losses, _, _ = task.loss(p, model_state, batch, jax.random.fold_in(jax.random.key(0), i))
      return getattr(losses, "values", losses).mean()  # Plain losses, or a `Weighted`'s values.
    updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for i in range(steps):
    params, opt_state = step(params, opt_state, i)
  return jax.tree.map(np.asarray, params)


# ---- a checkpoint of the exactness matrix's 3 uneven hosts x 2 devices, resumed on 2 x 1 ----

MODELS = ("resnet10", "transformer")  # BatchNorm (sgd); dropout (adam).


def train_and_save(until: int, reduction: str, assignment, folder: str, resume: bool):
  """Every model trained to step `until` with checkpoints in `folder/<model>`.

  Returns, per model, what `_exact_entries.matrix` does, with the step it
  resumed from in place of the shares: (params, model state, resumed from,
  (optimizer bytes per device, unsplit, the summary's memory figure)).
  """
  import jax
  from hetjax import checkpoint
  hetjax.initialize()
  out = {}
  for model in MODELS:
    source, task, optimizer = build(model)
    config = trainer.TrainConfig(global_batch=GLOBAL_BATCH, microbatch=BLOCK, seed=SEED,
                                 reduction=reduction, assignment=assignment)
    tr = trainer.Trainer(task, optimizer, source, config, checkpoint=checkpoint.CheckpointConfig(
        f"{folder}/{model}", every=until, resume=resume))
    summary = tr.fit(until=until)
    out[model] = (tr.params(), jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                            tr.mode.local_state.model_state),
                  tr.resumed_from, optimizer_memory(tr, summary))
    tr.close()
  return out


# ---- the reduction program's collectives, on one process with several devices ----

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
# (name, leaves, optimizer, precision, a device's sums overflow): fp32 rows with distinct
# weights and counts; fp16 rows, finite and with one device's sum infinite; the whole layout.
CASES = (("adam, 3 leaves", 3, "adam", "fp32", False),
         ("adam, 12 leaves", 12, "adam", "fp32", False),
         ("adam, fp16", 3, "adam", "fp16", False),
         ("adam, fp16 overflow", 3, "adam", "fp16", True),
         ("adafactor (whole)", 3, "adafactor", "fp32", False))


def _plain_rule(optimizer, params, opt_state, model_state, parts, precision_scale):
  """The update rule written with optax and numpy alone, from each device's sums:
  sum(grad sums) / sum(weights), optax, sum(model-state sums) / sum(counts); an
  fp16 sum that is not finite skips the update and halves the scale."""
  import jax
  import optax
  total = lambda key: jax.tree.map(lambda *xs: np.sum(np.stack(xs), 0),
                                   *[part[key] for part in parts])
  grads, states = total("grads"), total("model_state")
  weight = sum(part["weight"] for part in parts)
  count = sum(part["count"] for part in parts)
  finite = all(np.all(np.isfinite(x)) for x in jax.tree.leaves((grads, states)))
  if precision_scale is not None and not finite:
    return params, opt_state, model_state, precision_scale / 2
  updates, opt_state = optimizer.update(jax.tree.map(lambda g: g / weight, grads), opt_state,
                                        params)
  return (optax.apply_updates(params, updates), opt_state,
          jax.tree.map(lambda s: s / count, states), precision_scale)


def reduction_program(cases=CASES, devices: int = 4):
  """Per case of `cases`: (collectives in the compiled sharded update by kind, the largest
  difference of its new parameters, model state and optimizer state from `_plain_rule`'s,
  the loss scale after the step, the layout).

  Every device's sums drawn at random, weights and counts distinct per device.
  """
  import re
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from hetjax import step as step_lib
  from hetjax.step import packing, sharding
  from hetjax.step import precision as precision_lib
  from hetjax.step.state import Layout, Sums

  assert jax.local_device_count() == devices
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rng = np.random.default_rng(0)
  out = []
  for _, leaves, name, precision, overflow in cases:
    params = {f"w{i}": rng.normal(size=(3 + i, 5)).astype(np.float32) for i in range(leaves)}
    params["b"] = rng.normal(size=5).astype(np.float32)
    model_state = {"mean": rng.normal(size=7).astype(np.float32)}
    optimizer = (optax.adam(1e-2) if name == "adam" else
                 optax.adafactor(1e-2, min_dim_size_to_factor=2))
    scale = jax.device_get(precision_lib.initial_scale(precision))
    state = step_lib.TrainState(np.int32(0), params, optimizer.init(params), model_state, scale)
    scalar = np.float32(0)
    layout = Layout(packing.Packer(Sums(params, scalar, scalar, scalar, {"accuracy": scalar},
                                        model_state), dtype=jnp.float32), precision)
    parts = [{"grads": jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params),
              "weight": np.float32(rng.uniform(2, 9)), "count": np.float32(rng.integers(1, 9)),
              "model_state": jax.tree.map(lambda s: 8 * rng.normal(size=s.shape).astype(np.float32),
                                          model_state)} for _ in range(devices)]
    if overflow:
      parts[2]["grads"]["w0"][1, 1] = np.inf
    rows = [layout.sums.pack(Sums(part["grads"], part["weight"], part["count"],
                                  np.float32(rng.uniform(1, 3)),
                                  {"accuracy": np.float32(rng.uniform(0, 8))},
                                  part["model_state"]))["float32"] for part in parts]
    world = np.concatenate([np.stack(rows), np.full((devices, 1), scale.scale),
                            rng.normal(size=(devices, 2))], axis=1).astype(np.float32)
    layout_name = "whole" if name == "adafactor" else "sliced"
    update = sharding.ShardedUpdate(optimizer, mesh, "d", state, layout_name)
    program = jax.jit(lambda w, s: update.reduce_update(w, s, layout))
    laid = jax.device_put(world, NamedSharding(mesh, P("d")))
    shards = update.split(state)
    text = program.lower(laid, shards).compile().as_text()
    counts = {k: n for k in COLLECTIVES
              if (n := len(re.findall(rf"= [^=]*\b{k}(-start)?\(", text)))}
    new, _, stats, host_rows, _ = program(laid, shards)
    new = jax.device_get(update.join(new))
    fp16_scale = float(scale.scale) if precision == "fp16" else None
    want_params, want_opt, want_state, want_scale = _plain_rule(
        optimizer, params, optimizer.init(params), model_state, parts, fp16_scale)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves((new.params, new.model_state, new.opt_state)),
        jax.tree.leaves((want_params, want_state, want_opt)), strict=True))
    assert np.array_equal(np.asarray(host_rows)[:, 1:], world[:, -2:])
    out.append((counts, diff, float(new.loss_scale.scale), want_scale, layout_name))
  return out
