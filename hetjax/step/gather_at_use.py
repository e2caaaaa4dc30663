"""Each parameter leaf gathered where the loss uses it, forward and backward, and nowhere else.

Why: gathering every leaf before the loss (or naming the gathers for remat)
leaves XLA free to run them all at the program's start (XLA:CPU does), so
the whole parameters are live at once. Here the loss is traced once on
whole leaves, then replayed equation by equation: an equation that reads a
leaf runs under a `custom_vjp` that takes the leaf's rows, gathers them
only after its other inputs exist (`_tie`), and in the backward pass
gathers again only once the equation's cotangent exists. A gathered leaf
lives for one equation; its gradient leaves as rows (the gather's
transpose: a reduce-scatter). Generic over models: nothing in the model
changes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

PyTree = Any


def replay(fn: Callable, rows: PyTree, gather: Callable, *args: Any) -> Any:
  """`fn(whole, *args)` where `whole` are `rows` gathered leaf by leaf at each use.

  `gather(leaf_rows, leaf_index, tie)`: one leaf whole from its rows (inside a
  `shard_map`), gathered with `tie` (`[1, 1]` or None) so that it waits for it.
  """
  row_leaves, treedef = jax.tree.flatten(rows)
  probe = [gather(r, i, None) for i, r in enumerate(row_leaves)]  # Shapes only: unused, removed.
  flat_args, args_def = jax.tree.flatten(args)
  closed, out_shape = jax.make_jaxpr(
      lambda w, a: fn(jax.tree.unflatten(treedef, w), *jax.tree.unflatten(args_def, a)),
      return_shape=True)(probe, flat_args)
  jaxpr = closed.jaxpr
  n = len(row_leaves)
  leaf_of = {v: i for i, v in enumerate(jaxpr.invars[:n])}
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars[n:], flat_args))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    params = eqn.primitive.get_bind_params(eqn.params)
    slots = [k for k, v in enumerate(eqn.invars)
             if not isinstance(v, jex_core.Literal) and v in leaf_of]
    if slots:
      leaves = [leaf_of[eqn.invars[k]] for k in slots]
      out = _at_use(eqn, params, slots, leaves, gather)(
          [row_leaves[i] for i in leaves],
          [read(v) for k, v in enumerate(eqn.invars) if k not in slots])
    else:
      out = eqn.primitive.bind(*map(read, eqn.invars), **params)
    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
  return jax.tree.unflatten(jax.tree.structure(out_shape), [read(v) for v in jaxpr.outvars])


def _at_use(eqn: Any, params: dict, slots: list[int], leaves: list[int],
            gather: Callable) -> Callable:
  """The equation as a function of (its leaves' rows, its other inputs)."""

  def run(whole, others):
    it_w, it_o = iter(whole), iter(others)
    ins = [next(it_w) if k in slots else next(it_o) for k in range(len(eqn.invars))]
    return eqn.primitive.bind(*ins, **params)

  def gathered(rows, after):
    tie = _tie(after)
    return [gather(r, i, tie) for r, i in zip(rows, leaves)]

  @jax.custom_vjp
  def use(rows, others):
    return run(gathered(rows, others), others)

  def forward(rows, others):
    return use(rows, others), (rows, others)

  def backward(saved, cotangent):
    rows, others = saved
    whole, to_rows = jax.vjp(lambda r: gathered(r, cotangent), rows)
    _, pull = jax.vjp(run, whole, others)
    d_whole, d_others = pull(cotangent)
    return to_rows(d_whole)[0], d_others

  use.defvjp(forward, backward)
  return use


def _tie(values: Any) -> jax.Array | None:
  """One element of the first numeric array of `values`, `[1, 1]` float32; None if none.

  Gathered along with a leaf's rows, it makes the gather wait for `values`:
  a data dependence every compiler keeps (XLA:CPU drops an
  `optimization_barrier`'s ordering and merges the forward and backward
  gathers into one at the program's start).
  """
  for x in jax.tree.leaves(values):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.number) and x.size:
      return jax.lax.stop_gradient(x).reshape(-1)[:1].reshape(1, 1).astype(jnp.float32)
  return None
