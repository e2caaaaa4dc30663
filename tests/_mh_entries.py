"""Entry points that `tests/test_testing.py` runs on several hosts.

Module-level so that each host process can import them by name.
"""

from __future__ import annotations

import os

from hetjax.config import Env


def topology_and_sum(scale: float = 1.0) -> tuple[int, int, int, float, str | None]:
  """Returns where this host sits and a cross-host sum that only gloo can compute.

  Every device of host `i` contributes `scale * (i + 1)`, so the global sum
  proves that data from every host met in one collective.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()), ("hosts",))
  local = np.full((jax.local_device_count(),), scale * (jax.process_index() + 1), np.float32)
  global_array = jax.make_array_from_process_local_data(NamedSharding(mesh, P("hosts")), local)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(global_array)
  return (jax.process_index(), jax.process_count(), jax.local_device_count(), float(total),
          os.environ.get(Env.SPEED))


def fail_on_host(host: int) -> int:
  """Raises on `host`; the others wait in a collective that never completes."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == host:
    raise ValueError(f"deliberate failure on host {host}")
  topology_and_sum()
  return jax.process_index()


def die_on_host(host: int) -> int:
  """`host` prints a line and exits 3 without raising (as a C++ abort would)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() == host:
    print(f"last words of host {host}", flush=True)
    os._exit(3)
  return jax.process_index()


def read_env(name: str) -> str | None:
  """This host's value of environment variable `name`."""
  return os.environ.get(name)
