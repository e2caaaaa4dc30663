"""Which of a model's normalisation layers compute Flax's fast variance.

Why it matters: device batches run each block in kernels of another shape,
which round differently; the fast variance `E[x^2] - E[x]^2` cancels and
amplifies that rounding far past float reduction order. The trainer names
such layers before it compiles (`hetjax.modes.base.Setup.warn_fast_variance`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from hetjax.types import Batch, PyTree

# Flax's norm layers whose variance subtracts a mean (RMSNorm subtracts none).
NORM_LAYERS = ("BatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm")


def find(loss: Callable[..., Any], params: PyTree, model_state: PyTree, batch: Batch,
         known: Sequence[str] = ()) -> tuple[str, ...]:
  """The Flax normalisation layers `loss` calls that compute the fast variance, by path.

  Linen layers are found by tracing a `Task`'s training loss abstractly under
  `flax.linen.intercept_methods`; NNX layers come in `known`. (ResNet-18's
  BatchNorm scales: 8.7e-4 relative after one update, against 4.1e-6 with
  the stable variance.)
  """
  import flax.linen as nn  # Only a run that may need the answer pays for the import.

  kinds = tuple(getattr(nn, name) for name in NORM_LAYERS)
  found: dict[str, None] = dict.fromkeys(known)

  def record(call, args, kwargs, context):
    module = context.module
    if (context.method_name == "__call__" and isinstance(module, kinds)
        and getattr(module, "use_fast_variance", False)):
      found["/".join(module.path) or type(module).__name__] = None
    return call(*args, **kwargs)

  with nn.intercept_methods(record):
    # A fresh function: jax caches traces by function, and a cached one calls no module.
    jax.eval_shape(lambda *a: loss(*a), params, model_state, batch, jax.random.key(0))
  return tuple(found)


def nnx_layers(model: Any) -> tuple[str, ...]:
  """`find` for an NNX model: its norm layers with the fast variance, by path."""
  from flax import nnx
  kinds = tuple(getattr(nnx, name) for name in NORM_LAYERS if hasattr(nnx, name))
  return tuple("/".join(str(p) for p in path) or type(node).__name__
               for path, node in nnx.iter_graph(model)
               if isinstance(node, kinds) and getattr(node, "use_fast_variance", False))
