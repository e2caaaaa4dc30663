"""How a model takes its input images, whatever the compute precision."""

from __future__ import annotations

from typing import Any

import jax


def as_input(x: jax.Array, dtype: Any) -> jax.Array:
  """`x` in the module's compute `dtype`, or unchanged when it is None.

  With `dtype=None` the first layer promotes `x` with its parameters, so the
  model computes in whatever type hetjax cast the parameters to (float32,
  or bf16 / fp16 under `--precision`).
  """
  return x if dtype is None else x.astype(dtype)
