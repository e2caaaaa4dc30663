"""How a model takes its input images, whatever the compute precision."""

from __future__ import annotations

from typing import Any

import jax


def as_input(x: jax.Array, dtype: Any) -> jax.Array:
  """`x` in the module's compute `dtype`; None leaves it for the first layer to promote with
  the parameters (whatever `--precision` cast them to)."""
  return x if dtype is None else x.astype(dtype)
