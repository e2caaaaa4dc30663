"""The sharded update (ZeRO stage 1): each slice of the train state updated once, then gathered.

Hosts with unlike accelerators compile one update differently, so self-updated replicas drift
bit by bit. Here every state leaf is flattened, zero-padded to a multiple of the shard mesh's
size `S` and held `[S, c]`: device `i` alone updates row `i`. Sums arrive by one reduce-scatter;
the new parameters and model state leave by an explicit all-gather per dtype (no device
recomputes another's slice), packed for the local programs. Three collectives a step whatever
the leaf count (plus the optimizer's own, e.g. clipping's norm), where GSPMD made 24 for the
digits mlp and 30 for the cnn (`bench/multihost_step.py`).

Layouts (`hetjax.step.optimizer_layout` chooses at start):
- **sliced** (element-wise optimizers): optax runs under GSPMD on the slices, each seen with its
  real leaf's ndim (`optimizer_layout.view`), so masks, global-norm clipping and per-leaf norms
  survive; zero padding adds nothing to any sum. Scalar state stays replicated.
- **whole** (adafactor, Muon, shape-dependent masks, anything the probe tells apart): slices are
  gathered, the update runs on the real leaves on every device, each keeps its own slice of the
  result. Every state leaf, scalars too, is split, so each value has one owner.

The optimizer state costs `1/S` of its bytes per device (`memory_per_device`). The device
reduction shards over the world mesh; the host reduction over its CPU mesh (one per host).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax import mesh as mesh_lib
from hetjax.step import optimizer_layout as layout_lib
from hetjax.step import packing
from hetjax.step import precision as precision_lib
from hetjax.step import update as update_lib
from hetjax.step.optimizer_layout import columns, join_leaf, split_leaf  # noqa: F401
from hetjax.step.state import Layout, Sums

PyTree = Any


class Shards(NamedTuple):
  """The update's state, split over the shard mesh (see the module docstring)."""

  step: jax.Array                        # replicated
  params: PyTree                         # every leaf [S, c], row i on device i
  opt_state: PyTree                      # element-wise leaves [S, c]; scalars replicated
  model_state: PyTree                    # every leaf [S, c]
  loss_scale: precision_lib.LossScale    # replicated


def opt_kinds(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
              shards: int, layout: str) -> list[bool]:
  """Per optimizer-state leaf: True when it is split `[S, c]`, False when a replicated scalar
  (the whole layout splits every leaf, so every value has one owner)."""
  if layout == "whole":
    return [True] * len(jax.tree.leaves(opt_state))
  kinds = layout_lib.sliced_kinds(optimizer, params, opt_state, shards)
  if kinds is None:
    raise ValueError("the optimizer state is not element-wise (a factored optimizer such as "
                     "adafactor): its slices cannot be updated on their own; the update must "
                     "see whole leaves (update layout 'whole').")
  return kinds


class ShardedUpdate:
  """Splits, updates and gathers a train state over `axis` of `mesh` (the world's devices, or
  one CPU per host). `like`: the unsplit train state (arrays or shapes); `layout`: 'sliced'
  (optax on the slices: element-wise optimizers) or 'whole' (on the real leaves, each device
  keeping its slice: any optimizer), as `optimizer_layout.choose` picks."""

  def __init__(self, optimizer: optax.GradientTransformation, mesh: Mesh, axis: str, like: Any,
               layout: str = "sliced"):
    self.optimizer, self.mesh, self.axis, self.layout = optimizer, mesh, axis, layout
    self.size = mesh.devices.size
    self._state_type = type(like)
    self.like = layout_lib.shapes(like)
    self._opt_split = opt_kinds(optimizer, self.like.params, self.like.opt_state, self.size,
                                layout)
    split = NamedSharding(mesh, P(axis))
    self.replicated = NamedSharding(mesh, P())
    opt_def = jax.tree.structure(self.like.opt_state)
    self.shardings = Shards(
        self.replicated, jax.tree.map(lambda _: split, self.like.params),
        jax.tree.unflatten(opt_def, [split if s else self.replicated for s in self._opt_split]),
        jax.tree.map(lambda _: split, self.like.model_state),
        jax.tree.map(lambda _: self.replicated, self.like.loss_scale))
    # What the local programs need: everything but the optimizer state.
    self.replica_packer = packing.Packer(self.like._replace(opt_state=None))
    self._split = jax.jit(self._split_state, out_shardings=self.shardings)
    self._join = jax.jit(self._join_state, out_shardings=self.replicated)
    self._opt_programs = None  # (pack, unpack) of `local_opt_state`, built on first use
    self._replica = jax.jit(self._gathered_replica, out_shardings=self.replicated)

  # ---- Layout conversions (rare: init, restore, checkpoints, reads of the state) ----

  def _on_split_opt(self, fn, opt_state: PyTree) -> PyTree:
    """`fn(leaf, its unsplit shape)` on the optimizer-state leaves the layout splits;
    replicated scalars kept."""
    leaves, treedef = jax.tree.flatten(opt_state)
    return jax.tree.unflatten(treedef, [
        fn(x, like) if split else x
        for x, like, split in zip(leaves, jax.tree.leaves(self.like.opt_state), self._opt_split)])

  def _split_state(self, state: Any) -> Shards:
    split = lambda x, like=None: split_leaf(x, self.size)
    return Shards(state.step, jax.tree.map(split, state.params),
                  self._on_split_opt(split, state.opt_state),
                  jax.tree.map(split, state.model_state), state.loss_scale)

  def _join_state(self, shards: Shards) -> Any:
    join = lambda x, like: join_leaf(x, like.shape)
    return self._state_type(shards.step, jax.tree.map(join, shards.params, self.like.params),
                            self._on_split_opt(join, shards.opt_state),
                            jax.tree.map(join, shards.model_state, self.like.model_state),
                            shards.loss_scale)

  def onto_mesh(self, tree: PyTree) -> PyTree:
    """Replicated copies of `tree`'s leaves on the shard mesh (from any mesh, or numpy); others
    than those already there travel through host memory (init, restore, never per step)."""
    def move(x):
      if isinstance(x, jax.Array) and x.sharding == self.replicated:
        return x
      value = np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
      return jax.make_array_from_process_local_data(self.replicated, value)
    return jax.tree.map(move, tree)

  def split(self, state: Any) -> Shards:
    """A full train state (replicated, on any mesh) split into `Shards`."""
    return self._split(self.onto_mesh(state))

  def join(self, shards: Shards) -> Any:
    """The full train state, replicated over the shard mesh (a gather: for reads and saves)."""
    return self._join(shards)

  def local_opt_state(self, shards: Shards, meshes: Any) -> PyTree:
    """The whole optimizer state, replicated on this host's devices (`meshes.local`): packed on
    the shard mesh, so one buffer per dtype crosses, whatever the number of leaves."""
    if self._opt_programs is None:
      packer = packing.Packer(self.like.opt_state)
      pack = jax.jit(lambda s: packer.pack(self._join_state(s).opt_state),
                     out_shardings=self.replicated)
      unpack = jax.jit(packer.unpack, out_shardings=meshes.local_replicated)
      self._opt_programs = (pack, unpack)
    pack, unpack = self._opt_programs
    return unpack(self.to_local(pack(shards), meshes))

  def to_local(self, packed: packing.Packed, meshes: Any) -> packing.Packed:
    """Packed buffers replicated on the shard mesh, onto this host's devices."""
    if self.replicated == meshes.replicated:  # The device backend: zero-copy re-wraps.
      return {g: mesh_lib.to_local(x, meshes) for g, x in packed.items()}
    # The host backend's CPU mesh: through host memory.
    return {g: jax.device_put(np.asarray(x.addressable_data(0)), meshes.local_replicated)
            for g, x in packed.items()}

  def replica(self, shards: Shards, meshes: Any) -> packing.Packed:
    """The packed replica the shards make, on this host's devices (what a local program unpacks):
    each slice from its one owner, however differently the devices initialised or rounded."""
    return self.to_local(self._replica(shards), meshes)

  def _gathered_replica(self, shards: Shards) -> packing.Packed:
    params, model_state = gather_rows((shards.params, shards.model_state), self.mesh, self.axis)
    join = lambda x, like: join_leaf(x, like.shape)
    return self.replica_packer.pack(self.like._replace(
        step=shards.step, params=jax.tree.map(join, params, self.like.params), opt_state=None,
        model_state=jax.tree.map(join, model_state, self.like.model_state),
        loss_scale=shards.loss_scale))

  # ---- The update, traced inside a reduction's program over the shard mesh ----

  def reduce_update(self, world: jax.Array, shards: Shards, layout: Layout
                    ) -> tuple[Shards, packing.Packed, dict[str, jax.Array], jax.Array, jax.Array]:
    """Every device's sums added slice by slice, each slice updated once, the replica gathered.

    `world`: one `[n + 1 + k]` row per shard-mesh device (sums, loss scale, host vector). One
    reduce-scatter hands device `i` the summed slice row `i` (half an all-reduce's traffic);
    one small all-gather carries the scalar sums, loss scales and host vectors; the new slices
    return by one all-gather per dtype (`gather_rows`). Traced inside a reduction's program.

    Returns:
      (new shards, the packed replica, the step's statistics
      (`hetjax.step.step_stats`), every row's `[loss scale, host vector]`
      `[S, 1 + k]`, the update's learning rate or NaN).
    """
    n, size = layout.row_size, self.size
    sums_like = layout.sums.treedef.unflatten(
        [jax.ShapeDtypeStruct(slot.shape, dt)
         for slot, dt in zip(layout.sums.slots, layout.sums.leaf_dtypes)])
    # The sliced sums side by side, `[S, C]`; the scalars in a row of their own.
    sliced = packing.Packer(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((columns(math.prod(x.shape), size),), x.dtype),
        (sums_like.grads, sums_like.model_state)), dtype=jnp.float32)
    scalars = packing.Packer((sums_like.weight, sums_like.count, sums_like.loss,
                              sums_like.metrics), dtype=jnp.float32)

    def scatter(row):  # One device's `[1, n + 1 + k]`.
      sums = layout.sums.unpack({"float32": row[0, :n]}, cast=False)
      laid = jax.tree.map(lambda x: split_leaf(x, size), (sums.grads, sums.model_state))
      mine = jax.lax.psum_scatter(sliced.pack(laid, batch_dims=1)["float32"], self.axis,
                                  scatter_dimension=0, tiled=True)
      small = scalars.pack((sums.weight, sums.count, sums.loss, sums.metrics))["float32"]
      return mine, jax.lax.all_gather(jnp.concatenate([small, row[0, n:]]), self.axis)

    mine, small = jax.shard_map(
        scatter, mesh=self.mesh, in_specs=P(self.axis), out_specs=(P(self.axis), P()),
        # An all-gather's result is the same on every device (see `gather_rows`).
        check_vma=False)(world)
    grads, model_state = sliced.unpack({"float32": mine}, batch_dims=1)
    m = scalars.sizes["float32"]
    weight, count, loss, metrics = scalars.unpack({"float32": jnp.sum(small[:, :m], axis=0)})
    totals = Sums(grads, weight, count, loss, metrics, model_state)
    # fp16: some slice's or scalar's sum not finite, found wherever it lies.
    overflow = update_lib.overflowed(mine, layout) | update_lib.overflowed(small[:, :m], layout)
    if self.layout == "whole":
      new, lr = self._whole_step(shards, totals, overflow, layout)
    else:
      new, lr = self._sliced_step(shards, totals, overflow, layout)
    new = jax.lax.with_sharding_constraint(new, self.shardings)
    rows = small[:, m:]
    stats = update_lib.stats_of(totals, overflow, rows[0, 0], layout)
    return new, self._gathered_replica(new), stats, rows, lr


  def _sliced_step(self, shards: Shards, totals: Sums, overflow: jax.Array, layout: Layout
                   ) -> tuple[Shards, jax.Array]:
    """The update rule on the slices, each seen with its real leaf's ndim
    (`optimizer_layout.view`), so masks and labels by ndim choose as on one device."""
    like, size = self.like, self.size
    view = lambda x, like: layout_lib.view(x, like.shape)
    unview = lambda x, like=None: layout_lib.unview(x, size)
    seen = shards._replace(params=jax.tree.map(view, shards.params, like.params),
                           opt_state=self._on_split_opt(view, shards.opt_state),
                           model_state=jax.tree.map(view, shards.model_state, like.model_state))
    totals = totals._replace(grads=jax.tree.map(view, totals.grads, like.params),
                             model_state=jax.tree.map(view, totals.model_state, like.model_state))
    new, lr = update_lib.optimizer_step(self.optimizer, seen, totals, overflow, layout)
    return new._replace(params=jax.tree.map(unview, new.params),
                        opt_state=self._on_split_opt(unview, new.opt_state),
                        model_state=jax.tree.map(unview, new.model_state)), lr

  def _whole_step(self, shards: Shards, totals: Sums, overflow: jax.Array, layout: Layout
                  ) -> tuple[Shards, jax.Array]:
    """The update rule on the real leaves: slices gathered (one all-gather per dtype), optax on
    every device, each device's slice kept. Spelled out per device (`shard_map`), so GSPMD adds
    no collectives to partition the optimizer (it made 17 for adafactor on 4 devices)."""
    like, size, axis = self.like, self.size, self.axis
    join = lambda tree, shapes: jax.tree.map(lambda x, s: join_leaf(x, s.shape), tree, shapes)

    def per_device(rows, step, loss_scale, weight, count, overflow):
      grads, sums_state, params, opt_state, model_state = _all_gather_rows(rows, axis)
      whole = self._state_type(step, join(params, like.params), join(opt_state, like.opt_state),
                               join(model_state, like.model_state), loss_scale)
      sums = Sums(join(grads, like.params), weight, count, jnp.float32(0), {},
                  join(sums_state, like.model_state))
      new, lr = update_lib.optimizer_step(self.optimizer, whole, sums, overflow, layout)
      mine = lambda x: jax.lax.dynamic_slice_in_dim(split_leaf(x, size),
                                                    jax.lax.axis_index(axis), 1)
      own = jax.tree.map(mine, (new.params, new.opt_state, new.model_state))
      return own, new.step, new.loss_scale, lr

    rows = (totals.grads, totals.model_state, shards.params, shards.opt_state,
            shards.model_state)
    (params, opt_state, model_state), step, loss_scale, lr = jax.shard_map(
        per_device, mesh=self.mesh, in_specs=(P(axis), P(), P(), P(), P(), P()),
        out_specs=(P(axis), P(), P(), P()),
        # Replicated outputs are computed alike on every device from replicated inputs.
        check_vma=False)(rows, shards.step, shards.loss_scale, totals.weight, totals.count,
                         overflow)
    return Shards(step, params, opt_state, model_state, loss_scale), lr


def _all_gather_rows(tree: PyTree, axis: str) -> PyTree:
  """Inside a `shard_map`: every leaf's `[1, c]` row from every device, `[S, c]`, in
  one all-gather per dtype (the leaves side by side)."""
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    return tree
  rows = packing.Packer([jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves])
  gathered = {g: jax.lax.all_gather(x, axis, tiled=True)
              for g, x in rows.pack(leaves, batch_dims=1).items()}
  return jax.tree.unflatten(treedef, rows.unpack(gathered, batch_dims=1))


def gather_rows(tree: PyTree, mesh: Mesh, axis: str) -> PyTree:
  """Every device's rows of every `[S, c]` leaf, to every device, in one all-gather per dtype
  (each value from the one device that computed it; one per leaf would cost a ResNet-50
  hundreds of collectives a step)."""
  if not jax.tree.leaves(tree):
    return tree
  return jax.shard_map(
      lambda rows: _all_gather_rows(rows, axis), mesh=mesh, in_specs=P(axis), out_specs=P(),
      # An all-gather's result is the same on every device; the check cannot
      # infer it (jax.lax.all_gather_invariant is not public in this JAX).
      check_vma=False)(tree)


def split_tree(tree: PyTree, mesh: Mesh, axis: str, keep: PyTree = None) -> PyTree:
  """Every leaf of a replicated tree laid `[S, c]` over `mesh` (traced); leaves whose
  `keep` entry is True (scalars of an optimizer state) stay as they are."""
  size, sharding = mesh.devices.size, NamedSharding(mesh, P(axis))
  split = lambda x: jax.lax.with_sharding_constraint(split_leaf(x, size), sharding)
  if keep is None:
    return jax.tree.map(split, tree)
  return jax.tree.map(lambda x, k: x if k else split(x), tree, keep)


def gather_tree(tree: PyTree, like: PyTree, mesh: Mesh, axis: str, keep: PyTree = None
                ) -> PyTree:
  """`split_tree` undone through an explicit all-gather (traced): every device receives
  each slice from the one device that computed it."""
  keep = jax.tree.map(lambda _: False, like) if keep is None else keep
  leaves, treedef = jax.tree.flatten(tree)
  kept, shapes = jax.tree.leaves(keep), jax.tree.leaves(like)
  moving = gather_rows([x for x, k in zip(leaves, kept) if not k], mesh, axis)
  out, it = [], iter(moving)
  for x, k, shape in zip(leaves, kept, shapes):
    out.append(x if k else join_leaf(next(it), np.shape(shape)))
  return jax.tree.unflatten(treedef, out)


def scalar_leaves(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
                  shards: int) -> PyTree:
  """A tree like `opt_state`: True for the scalars a split update keeps whole
  (raises for a factored optimizer, as `ShardedUpdate` does)."""
  split = opt_kinds(optimizer, layout_lib.shapes(params), layout_lib.shapes(opt_state), shards, "sliced")
  return jax.tree.unflatten(jax.tree.structure(opt_state), [not s for s in split])


def tree_bytes(tree: PyTree) -> int:
  """Bytes of every array leaf of `tree` (arrays or shapes)."""
  return int(sum(math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))


def memory_per_device(like: Any, shards: int, optimizer: optax.GradientTransformation | None
                      = None, layout: str = "sliced") -> dict[str, dict[str, int]]:
  """Each device's bytes of parameters, optimizer state and gradients, unsplit and split.

  `split` (over `shards` devices): the whole parameters (the local programs need them), its
  `master_slice` and optimizer-state slice, and its whole float32 sums row. The whole layout
  also gathers the gradients and optimizer state during the update (`transient`).
  """
  like = layout_lib.shapes(like)
  params, opt, grads = tree_bytes(like.params), tree_bytes(like.opt_state), 4 * sum(
      math.prod(x.shape) for x in jax.tree.leaves(like.params))
  out = {"unsplit": {"params": params, "opt_state": opt, "grads": grads}}
  if shards > 1 and optimizer is not None:
    kinds = opt_kinds(optimizer, like.params, like.opt_state, shards, layout)
    split_bytes = lambda x: columns(math.prod(x.shape), shards) * jnp.dtype(x.dtype).itemsize
    opt_split = sum(split_bytes(x) if s else tree_bytes(x)
                    for x, s in zip(jax.tree.leaves(like.opt_state), kinds))
    master = sum(split_bytes(x) for x in jax.tree.leaves(like.params))
    out["split"] = {"params": params, "master_slice": master, "opt_state": int(opt_split),
                    "grads": grads}
    if layout == "whole":
      out["split"]["transient"] = params + opt + grads
  return out
