"""Is an optimizer element-wise? Read from its traced program, without running it.

Slices compute what the real leaves would, for any values, when `init` and `update` traced on
both layouts are one program up to shapes that combines values position by position only
(element-wise ops, broadcast scalars, calls of such programs, full sums of values 0 at the
padding: clipping's squared gradients; no other reduction, reshape or matmul). Tracing costs no
compile and no memory; anything else is left to the numeric probe (`optimizer_layout`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

PyTree = Any

_ELEMENTWISE = frozenset("""
    abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not
    or pow reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh
    xor""".split())
# Calls whose body is compared as a program of its own.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "remat", "checkpoint", "cond"})
# Parameters that name shapes or placement, or differentiation rules (never used
# here), not what is computed.
_IGNORED = frozenset({"shape", "broadcast_dimensions", "sharding", "out_sharding",
                      "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd",
                      "symbolic_zeros", "num_consts", "out_trees"})


def same_elementwise(optimizer: optax.GradientTransformation, real: PyTree, sliced: PyTree
                     ) -> bool:
  """True when `optimizer` provably computes alike on `real` and `sliced` parameter
  shapes (trees of `jax.ShapeDtypeStruct`, leaf by leaf the same sizes); False when
  this reading cannot tell (not that they differ)."""
  try:
    traces = []
    for params in (real, sliced):
      state = jax.eval_shape(optimizer.init, params)
      traces.append((jax.make_jaxpr(optimizer.init)(params),
                     jax.make_jaxpr(optimizer.update)(params, state, params)))
  except Exception:  # An optimizer that cannot be traced on one of the layouts.
    return False
  (init_real, update_real), (init_sliced, update_sliced) = traces
  # The gradients' padding is zero (the sums' slices are zero-padded); the rest unknown.
  grads = len(jax.tree.leaves(sliced))
  pads = [0.0] * grads + [None] * (len(update_sliced.jaxpr.invars) - grads)
  return (_same(init_real.jaxpr, init_sliced.jaxpr, init_real.consts, init_sliced.consts,
                [None] * len(init_sliced.jaxpr.invars)) is not None and
          _same(update_real.jaxpr, update_sliced.jaxpr, update_real.consts, update_sliced.consts,
                pads) is not None)


def _same(a: Any, b: Any, consts_a: list, consts_b: list, pads_in: list) -> list | None:
  """Two jaxprs equal up to shapes, element-wise operations only: the padding value of
  each of `b`'s outputs (a float, or None when unknown); None when not shown alike.

  `pads_in`: the padding value of each of `b`'s inputs. A reduction is allowed
  over every axis of a value whose padding is known to be 0 (a sum of squared
  gradients: clipping by the global norm), where padding adds nothing.
  """
  if (len(a.eqns), len(a.invars), len(a.outvars), len(a.constvars)) != (
      len(b.eqns), len(b.invars), len(b.outvars), len(b.constvars)):
    return None
  if not all(_equal_values(x, y) for x, y in zip(consts_a, consts_b)):
    return None
  names_a = {v: i for i, v in enumerate(list(a.constvars) + list(a.invars))}
  names_b = {v: i for i, v in enumerate(list(b.constvars) + list(b.invars))}
  pads = dict(zip(b.invars, pads_in))
  for ea, eb in zip(a.eqns, b.eqns):
    if ea.primitive.name != eb.primitive.name or not _operands_match(ea, eb, names_a, names_b):
      return None
    out = _eqn_pads(ea, eb, [_pad(x, pads) for x in eb.invars])
    if out is None:
      return None
    for va, vb, pad in zip(ea.outvars, eb.outvars, out):
      names_a[va] = names_b[vb] = len(names_a)
      pads[vb] = pad
  if not _atoms_match(a.outvars, b.outvars, names_a, names_b):
    return None
  return [_pad(x, pads) for x in b.outvars]


def _pad(x: Any, pads: dict) -> float | None:
  """The value `x` holds at padding positions: a literal's own; a var's as tracked."""
  return float(np.asarray(x.val)) if hasattr(x, "val") and np.size(x.val) == 1 else pads.get(x)


_PAD_OPS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
            "max": np.maximum, "min": np.minimum, "neg": np.negative, "abs": np.abs,
            "square": np.square, "sqrt": np.sqrt, "convert_element_type": lambda x: x,
            "copy": lambda x: x, "copy_p": lambda x: x}


def _eqn_pads(ea: Any, eb: Any, pads: list) -> list | None:
  """The padding values of `eb`'s outputs, or None when `ea` and `eb` are not shown alike."""
  name = ea.primitive.name
  if name == "broadcast_in_dim":  # A scalar broadcast: the same value at every position.
    if ea.invars[0].aval.shape != () or eb.invars[0].aval.shape != ():
      return None
    return [pads[0]]
  if name == "reduce_sum":  # Over every axis, of a value that is 0 at padding only.
    full = lambda e: tuple(e.params["axes"]) == tuple(range(len(e.invars[0].aval.shape)))
    return [None] if full(ea) and full(eb) and pads[0] == 0.0 else None
  if name in _ELEMENTWISE:
    if not (_position_wise(ea) and _position_wise(eb) and
            _plain(ea.params) == _plain(eb.params)):
      return None
    return [_eval_pad(name, ea.params, pads)]
  if name in _CALLS:
    subs_a, subs_b = _jaxprs(ea.params), _jaxprs(eb.params)
    if not subs_a or len(subs_a) != len(subs_b) or _plain(ea.params) != _plain(eb.params):
      return None
    inner = pads[1:] if name == "cond" else pads  # cond's first operand picks the branch.
    outs = [_same(_open(x)[0], _open(y)[0], _open(x)[1], _open(y)[1], inner)
            for x, y in zip(subs_a, subs_b)]
    if any(o is None for o in outs):
      return None
    return [p if all(o[i] == p for o in outs) else None for i, p in enumerate(outs[0])]
  return None


def _eval_pad(name: str, params: dict, pads: list) -> float | None:
  """An element-wise operation on known padding values (None if any is unknown)."""
  if any(p is None for p in pads):
    return None
  with np.errstate(all="ignore"):
    if name == "integer_pow":
      return float(np.float64(pads[0]) ** params["y"])
    op = _PAD_OPS.get(name)
    return None if op is None else float(op(*map(np.float64, pads)))


def _position_wise(eqn: Any) -> bool:
  """Every operand a scalar or of the result's shape (no broadcasting of a non-scalar)."""
  shape = eqn.outvars[0].aval.shape
  return all(x.aval.shape in ((), shape) for x in eqn.invars)


def _operands_match(ea: Any, eb: Any, names_a: dict, names_b: dict) -> bool:
  if len(ea.invars) != len(eb.invars):
    return False
  scalar = lambda x: x.aval.shape == ()
  return (_atoms_match(ea.invars, eb.invars, names_a, names_b) and
          all(scalar(x) == scalar(y) for x, y in zip(ea.invars, eb.invars)))


def _atoms_match(xs: list, ys: list, names_a: dict, names_b: dict) -> bool:
  for x, y in zip(xs, ys, strict=True):
    literal_x, literal_y = hasattr(x, "val"), hasattr(y, "val")
    if literal_x or literal_y:
      if not (literal_x and literal_y and _equal_values(x.val, y.val)):
        return False
    elif names_a.get(x, -1) != names_b.get(y, -2):
      return False
  return True


def _equal_values(x: Any, y: Any) -> bool:
  x, y = np.asarray(x), np.asarray(y)
  return x.dtype == y.dtype and x.shape == y.shape and bool(np.array_equal(x, y, equal_nan=True))


def _plain(params: dict) -> dict:
  """The parameters that say what is computed (sub-programs compared apart)."""
  return {k: repr(v) for k, v in params.items()
          if k not in _IGNORED and not _jaxprs({k: v})}


def _jaxprs(params: dict) -> list:
  """The (closed) jaxprs among `params`' values, in order (cond's branches included)."""
  found = []
  for value in params.values():
    for item in (value if isinstance(value, (list, tuple)) else (value,)):
      if hasattr(item, "eqns") or hasattr(item, "jaxpr"):
        found.append(item)
  return found


def _open(jaxpr: Any) -> tuple[Any, list]:
  """(jaxpr, consts) of a jaxpr or closed jaxpr."""
  return (jaxpr.jaxpr, list(jaxpr.consts)) if hasattr(jaxpr, "consts") else (jaxpr, [])
