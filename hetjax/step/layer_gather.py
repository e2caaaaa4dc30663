"""Each Flax layer gathers its own parameters where it runs, and again for its gradient.

Why: a device keeping slabs must see one layer's whole parameters at a time,
never all layers' (GSPMD annotations replicated the activations instead:
`bench/memory.py --parts gspmd`). Each module owning only parameters runs on
a copy given them whole, gathered after its inputs and, in the backward pass
(`custom_vjp`), after its cotangent, ordered by an `optimization_barrier`;
the gather's transpose reduce-scatters the gradient. Linen modules are met by
a method interceptor; NNX ones (of `task.NNX_MODELS`) get a subclass that
gathers in its methods, rebuilt by `nnx.scan` / `nnx.vmap` in their bodies (a
Variable getter alone keeps every layer's gathered leaves for the backward).
Other leaves (BatchNorm statistics, rngs, plain functions): at the loss's entry.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from hetjax import task as task_lib

PyTree = Any
Path = tuple[str, ...]
_STATE = threading.local()  # .inside: on a gathered copy; .run: (where, gather, layered).
_CLASSES: dict[type, type] = {}  # An NNX class -> its gathering subclass (one, for graphdefs).


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
      with _intercepting((where, None, found)):
        jax.eval_shape(loss, like, *shapes)
      layered.append(found)
    leaves, treedef = jax.tree.flatten(slabs)
    early = [x if a is None or p in layered[0] else gather(x, a, None)
             for x, p, a in zip(leaves, leaf_paths, axes)]
    with _intercepting((where, gather, layered[0])):
      return loss(jax.tree.unflatten(treedef, early), *args)

  return run


@contextlib.contextmanager
def _intercepting(run: tuple):
  """Linen's methods and NNX models' (`task.NNX_MODELS`) gather as `run` says, meanwhile."""
  _STATE.run, task_lib.NNX_MODELS.edit = run, _nnx_edit
  try:
    with nn.intercept_methods(_linen):
      yield
  finally:
    _STATE.run = task_lib.NNX_MODELS.edit = None


def _linen(next_fun, args, kwargs, context):
  """Runs each linen module owning only parameters on a copy given them whole."""
  module, run = context.module, _STATE.run
  if getattr(_STATE, "inside", False) or module.scope is None:
    return next_fun(*args, **kwargs)
  variables = module.variables
  own = dict(variables.get("params", {}))
  mine = _mine(run, own, tuple(module.path))
  if not mine or set(variables) != {"params"} or any(isinstance(v, Mapping) for v in own.values()):
    return next_fun(*args, **kwargs)
  if context.method_name == "setup":
    return None  # Its parameters are read whole by the copy; the slabs fail setup's checks.
  copy = module.clone(parent=None)

  def call(whole, a, k):
    out, wrote = copy.apply({"params": whole}, *a, method=context.method_name,
                            mutable=nn.DenyList("params"), **k)
    if any(module.is_mutable_collection(c) for c, v in wrote.items() if jax.tree.leaves(v)):
      raise ValueError("it sows what the loss keeps")  # Lost on a copy: the dry run falls back.
    return out

  return _layer(run, own, mine, args, kwargs, call, lambda: next_fun(*args, **kwargs))


def _nnx_edit(model: Any) -> Any:
  """`model` whose modules owning only `nnx.Param`s gather them in methods (`_slab_value`: too
  where others read them)."""
  from flax import nnx
  if nnx.Param not in _CLASSES:
    _CLASSES[nnx.Param] = type(nnx.Param)("Param", (nnx.Param,), {"get_value": _slab_value})
  for path, node in list(nnx.iter_graph(model)):
    flat = nnx.to_flat_state(nnx.state(node)) if isinstance(node, nnx.Module) else ()
    if not flat or not all(len(p) == 1 and isinstance(v, nnx.Param) for p, v in flat):
      continue
    kind = type(node)
    if kind not in _CLASSES:
      own = {n: f for c in reversed(kind.__mro__[:kind.__mro__.index(nnx.Module)])
             for n, f in vars(c).items() if hasattr(f, "__code__")}  # Functions, not static.
      _CLASSES[kind] = type(kind)(kind.__name__, (kind,), {
          n: _nnx_method(f) for n, f in own.items() if n == "__call__" or n[0] != "_"})
    node.__class__, node.hetjax_path = _CLASSES[kind], tuple(map(str, path))
    for (name,), v in flat:
      setattr(node, name, _CLASSES[nnx.Param].from_metadata(
          v.get_raw_value(), {**v.get_metadata(), "hetjax_path": node.hetjax_path + (name,)}))
  return model


def _slab_value(self, **kwargs):
  """A slab's whole value where code outside its module's methods reads it."""
  value, run, path = self.get_raw_value(), getattr(_STATE, "run", None), self.hetjax_path
  if run and run[1] is not None and not getattr(_STATE, "inside", False) and path in run[2]:
    value = _whole(run, path, value, None)
  return value[kwargs["index"]] if "index" in kwargs else value


def _nnx_method(f: Callable) -> Callable:
  def method(self, *args, **kwargs):
    if getattr(_STATE, "run", None) is None or getattr(_STATE, "inside", False):
      return f(self, *args, **kwargs)
    from flax import nnx
    graphdef, state = nnx.split(self)
    own = nnx.to_pure_dict(state, lambda v: v.get_raw_value())
    mine = _mine(_STATE.run, own, self.hetjax_path)
    if not mine:
      return f(self, *args, **kwargs)
    return _layer(_STATE.run, own, mine, args, kwargs, lambda whole, a, k: f(
        nnx.merge(graphdef, whole), *a, **k), lambda: f(self, *args, **kwargs))

  return method


def _mine(run: tuple, own: dict[str, Any], path: Path) -> dict[str, Path]:
  """The paths of a layer's leaves `own` if `run` may gather them in it (not one split on an
  axis a scan dropped), else {}."""
  where, gather, layered = run
  mine = {k: path + (k,) for k in own}
  for k, p in mine.items():
    axis, ndim = where.get(p, (-1, np.inf))
    if axis is not None and axis < ndim - np.ndim(own[k]):
      return {}
  return mine if gather is None or all(p in layered for p in mine.values()) else {}


def _whole(run: tuple, path: Path, x: jax.Array, after: Any) -> jax.Array:
  """The leaf at `path` whole from its slab `x` (a scan drops layer axes), after `after`."""
  axis, ndim = run[0][path]
  return x if axis is None else run[1](x, axis - (ndim - x.ndim), after)


def _layer(run: tuple, own: dict[str, Any], mine: dict[str, Path], args: tuple, kwargs: dict,
           call: Callable, fallback: Callable) -> Any:
  """`call(whole params, args, kwargs)` of one layer owning `own` (at `mine`), gathered as `run`
  says. `run`'s gather None: a dry run on whole leaves that adds to its `layered` the leaves
  of a layer that can run so; otherwise only those leaves are gathered here.
  """
  flat, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray))]

  def apply(whole, xs):
    full = dict(enumerate(flat)) | dict(zip(dynamic, xs))
    a, k = jax.tree.unflatten(treedef, list(full.values()))
    _STATE.inside = True
    try:
      return call(whole, a, k)
    finally:
      _STATE.inside = False

  xs = [flat[i] for i in dynamic]
  if run[1] is None:
    try:
      out = apply(own, xs)
    except Exception:  # noqa: BLE001 (rngs, mutable state: gathered at the loss's entry)
      return fallback()
    run[2].update(mine.values())
    return out

  whole = lambda slabs, after: {k: _whole(run, mine[k], x, after) for k, x in slabs.items()}

  @jax.custom_vjp
  def use(slabs, xs):
    return apply(whole(slabs, xs), xs)

  def backward(saved, cotangent):
    slabs, xs = saved
    gathered, to_slabs = jax.vjp(lambda s: whole(s, cotangent), slabs)
    d_whole, d_xs = jax.vjp(apply, gathered, xs)[1](cotangent)
    return to_slabs(d_whole)[0], d_xs

  use.defvjp(lambda slabs, xs: (use(slabs, xs), (slabs, xs)), backward)
  return use(own, xs)

