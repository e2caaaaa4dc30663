"""A pytree's leaves laid end to end in one flat buffer per dtype.

Every array crossing meshes costs ~0.1 ms of Python (a re-wrap): a ResNet-50's ~270 arrays
would cost tens of ms a step, more than a GPU step. Packed, they cross as one buffer per dtype;
(un)packing runs inside the compiled programs, where XLA fuses it into its neighbours.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any
Packed = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class _Slot:
  group: str      # dtype name: the buffer this leaf lives in
  offset: int
  shape: tuple[int, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)


class Packer:
  """The layout of `like`'s tree (arrays or shapes): which buffer and offset holds each leaf.
  `dtype`: every leaf cast to it, one buffer in all (float32 gradient sums whose leaves come in
  several precisions)."""

  def __init__(self, like: PyTree, dtype: Any = None):
    leaves, self.treedef = jax.tree.flatten(like)
    self.dtypes = tuple(jnp.dtype(dtype or x.dtype) for x in leaves)
    self.leaf_dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
    sizes: dict[str, int] = {}
    slots = []
    for x, dt in zip(leaves, self.dtypes):
      slots.append(_Slot(dt.name, sizes.get(dt.name, 0), tuple(x.shape)))
      sizes[dt.name] = sizes.get(dt.name, 0) + math.prod(x.shape)
    self.slots = tuple(slots)
    self.sizes = dict(sorted(sizes.items()))

  def pack(self, tree: PyTree, batch_dims: int = 0) -> Packed:
    """`{dtype name: [*batch, total]}`; leaves keep their first `batch_dims` axes."""
    leaves = self.treedef.flatten_up_to(tree)
    parts: dict[str, list[jax.Array]] = {name: [] for name in self.sizes}
    for x, slot, dt in zip(leaves, self.slots, self.dtypes):
      x = jnp.asarray(x).astype(dt)
      parts[slot.group].append(x.reshape(x.shape[:batch_dims] + (slot.size,)))
    return {name: (jnp.concatenate(p, axis=batch_dims) if len(p) > 1 else p[0])
            for name, p in parts.items()}

  def unpack(self, packed: Packed, batch_dims: int = 0, cast: bool = True) -> PyTree:
    """The tree back from `pack`'s buffers; with `cast`, in the leaves' own dtypes."""
    leaves = []
    for slot, dt in zip(self.slots, self.leaf_dtypes):
      buf = packed[slot.group]
      batch = buf.shape[:batch_dims]
      x = jax.lax.slice_in_dim(buf, slot.offset, slot.offset + slot.size, axis=batch_dims)
      x = x.reshape(batch + slot.shape)
      leaves.append(x.astype(dt) if cast else x)
    return self.treedef.unflatten(leaves)
