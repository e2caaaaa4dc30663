"""Each Flax layer gathers its own parameters where it runs, and again for its gradient.

Why: a device keeping slabs must see one layer's whole parameters at a
time, never all layers' (GSPMD annotations replicated the activations
instead: `bench/memory.py --parts gspmd`). A method interceptor (it reaches
inside `nn.scan`, `nn.remat` and a jitted loss) runs each module owning only
parameters on a copy given them whole, gathered after its inputs and, in the
backward pass (`custom_vjp`), after its cotangent, ordered by an
`optimization_barrier` that no compiler may hoist past; the gather's
transpose reduce-scatters the gradient. Other leaves (BatchNorm statistics,
rngs, NNX, plain functions) are gathered at the loss's entry.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

PyTree = Any
Path = tuple[str, ...]
_STATE = threading.local()  # .inside: a module being run on its gathered copy.


def paths(tree: PyTree) -> list[Path]:
  """Each leaf's path as a tuple of keys (a linen module's path plus the parameter's name)."""
  return [tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def wrap(loss: Callable, like: PyTree, axes: list[int | None],
         gather: Callable[[jax.Array, int, Any], jax.Array]) -> Callable:
  """`loss(slabs, *args)`: `loss` on parameters given as slabs (leaf `i` split on `axes[i]`).

  `gather(slab, axis, after)`: the whole leaf (inside a `shard_map`), gathered after `after`.
  """
  leaf_paths = paths(like)
  where = {p: (a, len(x.shape)) for p, a, x in zip(leaf_paths, axes, jax.tree.leaves(like))}
  layered: list[set[Path]] = []  # Found at the first trace: the leaves a layer gathers.

  def run(slabs, *args):
    if not layered:
      found: set[Path] = set()
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
      with nn.intercept_methods(_interceptor(where, None, found)):
        jax.eval_shape(loss, like, *shapes)
      layered.append(found)
    leaves, treedef = jax.tree.flatten(slabs)
    early = [x if a is None or p in layered[0] else gather(x, a, None)
             for x, p, a in zip(leaves, leaf_paths, axes)]
    with nn.intercept_methods(_interceptor(where, gather, layered[0])):
      return loss(jax.tree.unflatten(treedef, early), *args)

  return run


def _interceptor(where: dict[Path, tuple[int | None, int]], gather: Callable | None,
                 layered: set[Path]) -> Callable:
  """Runs each module owning only parameters on a copy given them whole.

  `gather` None: a dry run on whole leaves that adds to `layered` each leaf
  whose module can run so; otherwise only those leaves are gathered here.
  """

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if getattr(_STATE, "inside", False) or module.scope is None:
      return next_fun(*args, **kwargs)
    variables = module.variables
    own = dict(variables.get("params", {}))
    mine = {k: tuple(module.path) + (k,) for k in own}
    if (not own or set(variables) != {"params"} or any(isinstance(v, Mapping) for v in own.values())
        or not all(_splittable(where.get(p), own[k]) for k, p in mine.items())
        or (gather is not None and not all(p in layered for p in mine.values()))):
      return next_fun(*args, **kwargs)
    if context.method_name == "setup":
      return None  # Its parameters are read whole by the copy; the slabs fail setup's checks.
    flat, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray))]
    copy = module.clone(parent=None)

    def apply(whole, xs):
      full = list(flat)
      for i, x in zip(dynamic, xs):
        full[i] = x
      a, k = jax.tree.unflatten(treedef, full)
      _STATE.inside = True
      try:
        return copy.apply({"params": whole}, *a, method=context.method_name, **k)
      finally:
        _STATE.inside = False

    xs = [flat[i] for i in dynamic]
    if gather is None:
      try:
        out = apply(own, xs)
      except Exception:  # noqa: BLE001 (rngs, mutable state: gathered at the loss's entry)
        return next_fun(*args, **kwargs)
      layered.update(mine.values())
      return out

    def whole(slabs, after):
      out = {}
      for k, x in slabs.items():
        axis, ndim = where[mine[k]]
        # Inside `nn.scan` the layer axes are gone: the split axis moves down with them.
        out[k] = x if axis is None else gather(x, axis - (ndim - x.ndim), after)
      return out

    @jax.custom_vjp
    def use(slabs, xs):
      return apply(whole(slabs, xs), xs)

    def forward(slabs, xs):
      return use(slabs, xs), (slabs, xs)

    def backward(saved, cotangent):
      slabs, xs = saved
      gathered, to_slabs = jax.vjp(lambda s: whole(s, cotangent), slabs)
      d_whole, d_xs = jax.vjp(apply, gathered, xs)[1](cotangent)
      return to_slabs(d_whole)[0], d_xs

    use.defvjp(forward, backward)
    return use(own, xs)

  return intercept


def _splittable(axis_ndim: tuple[int | None, int] | None, x: Any) -> bool:
  """Whether a module's leaf, as it sees it, still has its split axis (`nn.scan` drops layers')."""
  if axis_ndim is None:
    return False
  axis, ndim = axis_ndim
  return axis is None or axis >= ndim - np.ndim(x)
