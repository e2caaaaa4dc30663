"""Which layout the sharded update gives the optimizer: slices, or whole leaves.

An element-wise optimizer (sgd, momentum, adam, lion, lamb's per-leaf norms, global-norm
clipping) computes the same on the `[S, c]` slices as on the real leaves, so each device updates
only its slice (cheapest). One that depends on a leaf's shape (a mask by `ndim`, adafactor,
Muon) runs on the real leaves ("whole"), each device keeping its slice of the result.

Decided before any training program compiles: first from the traced program
(`hetjax.step.elementwise`), else by `probe` on this host's CPU: `PROBE_STEPS` updates on
stand-ins of the real shapes, as leaves and as slices, compared; one the probe cannot tell apart
(global-norm clipping, lamb) computes the same up to float order, one it can gets "whole".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hetjax.config import UPDATE_LAYOUTS
from hetjax.mesh import gather_host_values
from hetjax.step import elementwise

PyTree = Any

PROBE_STEPS = 3
# The largest relative difference (of a leaf's update, against its largest
# value) that float order may cause between the two layouts: clipping by the
# global norm sums in another order (~1e-7 measured). Stand-in parameters are
# ten times the gradients, so a weight decay of 1e-6 applied to the wrong
# leaves still differs by 1e-5 of an sgd update.
TOLERANCE = 1e-5
_PARAM_SCALE = 10.0
# Below this many parameters the probe compiles with XLA's cheap passes (an mlp's
# 0.7 -> 0.1 s); above, with its defaults, whose code runs a ResNet-50's probe
# many times faster than the cheap passes' (bench/optimizer_memory.py).
_SMALL = 2 ** 20
_CHEAP = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
          "xla_cpu_parallel_codegen_split_count": 1}


@dataclasses.dataclass(frozen=True)
class Choice:
  """The layout the sharded update uses, and why (said once at start)."""

  layout: str        # 'sliced' or 'whole'
  reason: str


def columns(size: int, shards: int) -> int:
  """The row length `c` of a leaf of `size` values split `shards` ways (at least 1)."""
  return max(1, -(-size // shards))


def split_leaf(x: jax.Array, shards: int) -> jax.Array:
  """`x` flattened, zero-padded and laid out `[shards, c]` (traced)."""
  flat = jnp.ravel(x)
  c = columns(flat.size, shards)
  return jnp.pad(flat, (0, shards * c - flat.size)).reshape(shards, c)


def join_leaf(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`split_leaf` undone: the first `prod(shape)` values in `shape` (traced)."""
  return jnp.ravel(x)[:math.prod(shape)].reshape(shape)


def view(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A `[S, c]` leaf as the optimizer sees it: flat rows, with the real leaf's ndim
  (`(S * c,)` for a vector, `(S * c, 1, ...)` for a matrix or more), so masks and
  labels by `ndim` choose as they do on the real leaf. A reshape of the split axis
  with whole rows: no data moves between devices."""
  if len(shape) == 0:
    return x
  return x.reshape((x.size,) + (1,) * (len(shape) - 1))


def view_shape(shape: tuple[int, ...], shards: int) -> tuple[int, ...]:
  """The shape `view` gives a leaf of `shape` split `shards` ways."""
  c = columns(math.prod(shape), shards)
  return (shards, c) if len(shape) == 0 else (shards * c,) + (1,) * (len(shape) - 1)


def unview(x: jax.Array, shards: int) -> jax.Array:
  """`view` undone: back to `[S, c]`."""
  return x.reshape(shards, -1)


def sliced_kinds(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
                 shards: int) -> list[bool] | None:
  """Per optimizer-state leaf, True when the sliced layout splits it, False for a scalar kept
  whole; None when the state follows the leaves' shapes (factored, labels by shape). Shapes
  only (`jax.eval_shape`): nothing runs."""
  try:
    split_state = jax.eval_shape(optimizer.init, _view_shapes(params, shards))
  except Exception:  # An optimizer that cannot even start on matrices of slices.
    return None
  full, treedef = jax.tree.flatten(opt_state)
  split, split_def = jax.tree.flatten(split_state)
  if treedef != split_def:
    return None
  kinds = []
  for f, s in zip(full, split):
    if np.shape(f) == () and s.shape == ():
      kinds.append(False)
    elif np.ndim(f) > 0 and s.shape == view_shape(tuple(np.shape(f)), shards):
      kinds.append(True)
    else:
      return None
  return kinds


def shapes(tree: PyTree) -> PyTree:
  """`tree`'s leaves (arrays or shapes) as `jax.ShapeDtypeStruct`s."""
  return jax.tree.map(lambda p: jax.ShapeDtypeStruct(tuple(np.shape(p)), p.dtype), tree)


def _view_shapes(params: PyTree, shards: int) -> PyTree:
  return jax.tree.map(lambda p: jax.ShapeDtypeStruct(
      view_shape(tuple(np.shape(p)), shards), p.dtype), params)


def _stand_ins(params: PyTree) -> tuple[PyTree, PyTree]:
  """Parameters and a gradient of the real shapes, fixed values (every host alike)."""
  rng = np.random.default_rng(0)
  draw = lambda p, scale: (scale * rng.standard_normal(tuple(p.shape))).astype(p.dtype)
  return (jax.tree.map(lambda p: draw(p, _PARAM_SCALE), params),
          jax.tree.map(lambda p: draw(p, 1.0), params))


def _updates(optimizer: optax.GradientTransformation, params: PyTree, grad: PyTree,
             lay, unlay) -> PyTree:
  """`PROBE_STEPS` steps' updates (stacked, in the real shapes) with the leaves laid out
  by `lay`; step `i`'s gradient is `grad` times `1 - i / 2`, so its sign and size change."""
  def step(carry, factor):
    p, s = carry
    u, s = optimizer.update(jax.tree.map(lambda g: lay(g * factor.astype(g.dtype)), grad), s, p)
    return (optax.apply_updates(p, u), s), jax.tree.map(unlay, u, params)

  laid = jax.tree.map(lay, params)
  factors = 1.0 - jnp.arange(PROBE_STEPS, dtype=jnp.float32) / 2
  return jax.lax.scan(step, (laid, optimizer.init(laid)), factors)[1]


def probe(optimizer: optax.GradientTransformation, params: PyTree, shards: int
          ) -> tuple[str, float] | None:
  """The leaf whose updates differ most between the real and the sliced layout, and by
  how much (relative to the leaf's largest update); None when they agree within
  `TOLERANCE`. A probe whose updates are all zero proves nothing: it returns
  ('every leaf', inf).
  """
  values, grads = _stand_ins(shapes(params))

  def both(values, grads):
    real = _updates(optimizer, values, grads, lambda x: x, lambda x, like: x)
    sliced = _updates(optimizer, values, grads, lambda x: view(split_leaf(x, shards), x.shape),
                      lambda x, like: join_leaf(x, np.shape(like)))
    def gap(a, b):
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
      scale = jnp.max(jnp.abs(a))
      return jnp.stack([jnp.max(jnp.abs(a - b)) / jnp.where(scale > 0, scale, 1.0), scale])
    return jax.tree.map(gap, real, sliced)

  cpu = jax.local_devices(backend="cpu")[0]
  with jax.default_device(cpu):
    # A small model's probe is mostly compile time, a large one's mostly run time.
    small = sum(math.prod(np.shape(p)) for p in jax.tree.leaves(params)) < _SMALL
    probe_program = jax.jit(both).lower(values, grads).compile(
        compiler_options=_CHEAP if small else None)
    gaps = jax.device_get(probe_program(values, grads))
  named = [(jax.tree_util.keystr(path), g) for path, g in
           jax.tree_util.tree_flatten_with_path(gaps)[0]]
  if not any(g[1] > 0 for _, g in named):
    return "every leaf", math.inf
  name, worst = max(named, key=lambda item: item[1][0])
  return None if worst[0] <= TOLERANCE else (name or "the parameters", float(worst[0]))


def choose(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
           shards: int, requested: str = "auto") -> Choice:
  """The layout (and its reason, said at start) for `optimizer` on parameters shaped like
  `params` (arrays or shapes), split `shards` ways. `requested`: 'auto' (probe and choose),
  'whole' (no probe) or 'sliced' (a ValueError naming the leaf when the optimizer needs whole
  leaves)."""
  if requested not in UPDATE_LAYOUTS:
    raise ValueError(f"update layout {requested!r} is not one of {UPDATE_LAYOUTS}.")
  if requested == "whole":
    return Choice("whole", "asked for")
  if sliced_kinds(optimizer, params, opt_state, shards) is None:
    found = ("its state is not element-wise (a factored optimizer such as adafactor, a "
             "matrix-wise one such as Muon, or labels by shape keep state shaped by the "
             "leaves' dimensions)")
  elif elementwise.same_elementwise(optimizer, shapes(params), _view_shapes(params, shards)):
    return Choice("sliced", "the optimizer is element-wise (read from its program)")
  else:
    gap = probe(optimizer, params, shards)
    if gap is None:
      return Choice("sliced", "the optimizer computes alike on slices (probed)")
    leaf, by = gap
    found = (f"its updates depend on the leaves' shapes (leaf {leaf} differs by {by:.2g} of "
             "its update on slices: a mask or label by ndim or shape, or a matrix-wise update "
             "such as Muon)" if math.isfinite(by) else
             f"its first {PROBE_STEPS} updates are all zero (a warm-up from 0, or gradient "
             "accumulation), so the probe could not tell")
  if requested == "sliced":
    raise ValueError(f"update layout 'sliced' refused: {found}. Use update layout 'auto' or "
                     "'whole', which update whole leaves and are exact for any optimizer.")
  return Choice("whole", found)


def for_hosts(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree,
              shards: int, requested: str, meshes: Any) -> Choice:
  """`choose` on every host, agreed: whole leaves if any host's probe asked for them.

  Float order could put a borderline probe on both sides of `TOLERANCE` on two machines, and
  every host must lay the state out alike (one collective). Host 0 says the choice once.
  """
  choice = choose(optimizer, params, opt_state, shards, requested)
  wants_whole = gather_host_values(np.array([choice.layout == "whole"], np.float32), meshes)
  if choice.layout == "sliced" and wants_whole[:, 0].any():
    host = int(np.argmax(wants_whole[:, 0]))
    choice = Choice("whole", f"host {host}'s probe found the update depends on leaf shapes")
  if meshes.host_id == 0:
    print(f"hetjax: the sharded update runs the optimizer on {choice.layout} leaves over "
          f"{shards} devices: {choice.reason}.", flush=True)
  return choice
