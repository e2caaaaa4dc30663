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
  from hetjax.modes import RoundsConfig
  from hetjax.modes.rounds_trainer import RoundsTrainer
  out = mixed_compilers(steps, check_every)
  source = data.load("digits")
  for mode, reduction in ROUND_MODES:
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(32,))
    config = trainer.TrainConfig(global_batch=32, microbatch=16, seed=0, reduction=reduction)
    tr = RoundsTrainer(task, optimizers.make("adam", 0.003, clip_norm=1.0), source, config,
                       RoundsConfig(mode=mode, local_steps=(2, 2)))
    tr.fit(rounds)
    out.append((None, tr.params()))
    tr.close()
  return out


# ---- a checkpoint of the exactness matrix's 3 uneven hosts x 2 devices, resumed on 2 x 1 ----

MODELS = ("resnet18", "transformer")  # BatchNorm (sgd); dropout (adam).


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
                                            tr.local_state.model_state),
                  tr.resumed_from, optimizer_memory(tr, summary))
    tr.close()
  return out


# ---- the reduction program's collectives, on one process with several devices ----

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def reduction_program(leaf_counts, devices: int = 4):
  """Per leaf count: (collectives in the compiled sharded update by kind, the largest
  difference of its new parameters, model state and loss from the unsplit rule's).

  A model of `leaf_count` parameter leaves and one model-state leaf; every
  device's sums row drawn at random; adam. The unsplit rule (`apply_update`
  on the rows' sum) is the oracle.
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
  for leaves in leaf_counts:
    params = {f"w{i}": rng.normal(size=(3 + i, 5)).astype(np.float32) for i in range(leaves)}
    model_state = {"mean": rng.normal(size=7).astype(np.float32)}
    optimizer = optax.adam(1e-2)
    state = step_lib.TrainState(np.int32(0), params, optimizer.init(params), model_state,
                                jax.device_get(precision_lib.initial_scale("fp32")))
    scalar = np.float32(0)
    sums_like = Sums(params, scalar, scalar, scalar, {"accuracy": scalar}, model_state)
    layout = Layout(packing.Packer(sums_like, dtype=jnp.float32), "fp32")
    rows = [layout.sums.pack(Sums(
        jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params),
        np.float32(8), np.float32(8), np.float32(rng.uniform(1, 3)),
        {"accuracy": np.float32(rng.uniform(0, 8))},
        jax.tree.map(lambda s: 8 * rng.normal(size=s.shape).astype(np.float32), model_state))
    )["float32"] for _ in range(devices)]
    world = np.concatenate([np.stack(rows), np.ones((devices, 1)), rng.normal(size=(devices, 2))],
                           axis=1).astype(np.float32)
    update = sharding.ShardedUpdate(optimizer, mesh, "d", state)
    program = jax.jit(lambda w, s: update.reduce_update(w, s, layout))
    laid = jax.device_put(world, NamedSharding(mesh, P("d")))
    shards = update.split(state)
    text = program.lower(laid, shards).compile().as_text()
    counts = {k: n for k in COLLECTIVES
              if (n := len(re.findall(rf"= [^=]*\b{k}(-start)?\(", text)))}
    new, _, stats, host_rows, _ = program(laid, shards)
    new = jax.device_get(update.join(new))
    expected, _ = step_lib.apply_update(optimizer, jax.tree.map(jnp.asarray, state),
                                        jnp.asarray(world[:, :layout.row_size].sum(0)), layout)
    expected_stats = step_lib.step_stats(jnp.asarray(world[:, :layout.row_size].sum(0)),
                                         jnp.float32(1), layout)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves((new.params, new.model_state, new.opt_state)),
        jax.tree.leaves((expected.params, expected.model_state, expected.opt_state))))
    diff = max(diff, *(abs(float(stats[k]) - float(expected_stats[k])) for k in expected_stats))
    assert np.array_equal(np.asarray(host_rows)[:, 1:], world[:, -2:])
    out.append((counts, diff))
  return out
