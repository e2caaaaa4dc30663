"""The type names every floor shares, in a leaf module that imports no hetjax."""

from typing import Any

import jax

PyTree = Any
Batch = dict[str, jax.Array]  # Arrays with a common leading dimension (`hetjax.task`).
