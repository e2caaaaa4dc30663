"""Snapshots of a replicated state: safe from donation, one replica per host, both paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.checkpoint import snapshot


def _replicated_tree():
  mesh = Mesh(np.array(jax.devices()), ("all",))
  make = jax.jit(lambda: {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.int32(7)},
                 out_shardings=NamedSharding(mesh, PartitionSpec()))
  return make()


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copy"])
def test_a_snapshot_keeps_the_values_it_was_taken_with_after_the_tree_is_donated(copy):
  tree = _replicated_tree()
  taken = snapshot.SnapshotTaker(copy=copy).take(tree)
  overwrite = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
  overwritten = overwrite(tree)
  assert int(overwritten["step"]) == -1
  if copy:  # The copy is the snapshot's own; the tree's buffers were really donated.
    assert tree["w"].is_deleted()
  saved = taken.as_global()
  np.testing.assert_array_equal(np.asarray(saved["w"]), np.arange(12.0).reshape(3, 4))
  assert int(saved["step"]) == 7
  hosts = saved["w"].sharding
  assert hosts.is_fully_replicated and hosts.mesh.devices.size == jax.process_count()
  assert hosts.memory_kind == ("pinned_host" if copy else "device")


def test_a_tree_that_is_not_replicated_on_one_mesh_is_refused_by_name():
  mesh = Mesh(np.array(jax.devices()[:1]), ("all",))
  sharded = jax.device_put(jnp.zeros(4), NamedSharding(mesh, PartitionSpec("all")))
  plain = jax.device_put(jnp.zeros(4), jax.devices()[0])
  with pytest.raises(ValueError, match="replicated on one mesh"):
    snapshot.SnapshotTaker().take({"a": plain, "b": sharded})
