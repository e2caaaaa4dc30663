"""Hosts' agreement, checked rather than hoped for (DESIGN invariant 3).

Rounding cannot make replicas drift (invariant 6), but a real fault can (a
stale checkout, a damaged copy): hosts would read overlapping slices or train
different models, silently. So the shares travel in every step's timing rows
(`check_shares`); every `check_every` steps and at every checkpoint the
parameters' fingerprints are compared (`check_replicas`); at start-up a hash
of the configuration, shapes and optimizer structure (`agree_on`). Hashes
travel in float32 rows as 16-bit chunks, which float32 holds exactly.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import mesh as mesh_lib
from hetjax.config import fingerprint as text_fingerprint  # noqa: F401 (JAX-free, shared with the doctor)
from hetjax.exits import JobExit

PyTree = Any
FINGERPRINT_WIDTH = 4  # float32 values per parameter fingerprint (2 x uint32).


class HostsDisagree(JobExit):
  """Hosts that must hold the same values do not; every host raises it at the same step.

  Raised by `Trainer.check_params_agree` (every `check_every` steps and
  before each checkpoint); the message names the hosts. Args: the message.

  Example:
    >>> error = hetjax.HostsDisagree("after step 8: host(s) [1] hold other parameters")
    >>> error.exit_code, isinstance(error, RuntimeError)
    (1, True)
  """

  label = "error: "


def _odd_weights(n: int, multiplier: int) -> jax.Array:
  return jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(multiplier) + jnp.uint32(1)


@jax.jit
def _fingerprint_words(params: PyTree) -> jax.Array:
  """Two weighted sums of the parameters' bit patterns, wrapping in uint32: exact in any
  order, so hosts agree when their parameters do bit for bit; the weights catch a swap."""
  total = jnp.zeros((2,), jnp.uint32)
  for i, leaf in enumerate(jax.tree.leaves(params)):
    bits = jax.lax.bitcast_convert_type(jnp.ravel(leaf).astype(jnp.float32), jnp.uint32)
    words = jnp.stack([jnp.sum(bits * _odd_weights(bits.size, 2654435761)),
                       jnp.sum(bits * _odd_weights(bits.size, 40503))])
    total = total + words * jnp.uint32(2 * i + 1)
  return total


def params_fingerprint(local_params: PyTree) -> np.ndarray:
  """This host's parameter fingerprint, `FINGERPRINT_WIDTH` float32 values, computed on its
  own devices (`local_params`: no cross-host program)."""
  words = np.asarray(jax.device_get(_fingerprint_words(local_params)), np.uint32)
  return words.view(np.uint16).astype(np.float32)


def _differing(rows: np.ndarray) -> tuple[list[int], int]:
  """Hosts whose row differs from the most common row, and a host holding it."""
  keys = [r.tobytes() for r in np.asarray(rows, np.float32)]
  majority = max(set(keys), key=lambda k: (keys.count(k), -keys.index(k)))
  reference = keys.index(majority)
  return [h for h, k in enumerate(keys) if k != majority], reference


def check_shares(step: int, rows: np.ndarray) -> None:
  """Raises `HostsDisagree` unless every host used the same shares at `step` (`rows[h]`:
  the shares host `h` used)."""
  differ, ref = _differing(rows)
  if differ:
    used = "; ".join(f"host {h} used {tuple(int(v) for v in rows[h])}" for h in differ)
    raise HostsDisagree(
        f"step {step}: host(s) {differ} computed another split of the global batch than host "
        f"{ref}, which used {tuple(int(v) for v in rows[ref])}; {used}. Hosts read overlapping or missing "
        "samples, so the job stops. Every host must run the same code and the same balancer.")


def check_fingerprints(step: int, rows: np.ndarray, what: str = "parameters") -> None:
  """Raises `HostsDisagree` unless every host's fingerprint row is the same."""
  differ, ref = _differing(rows)
  if differ:
    raise HostsDisagree(
        f"after step {step}: host(s) {differ} hold other {what} than host {ref}: their "
        "replicas diverged (different code or model on those hosts, or a numerical "
        "difference); the job stops before it trains on.")


def check_all_equal(rows: np.ndarray, *, what: str, fix: str) -> None:
  """Start-up check: every host's hash row equals host 0's."""
  rows = np.asarray(rows)
  differ = [h for h in range(len(rows)) if not np.array_equal(rows[h], rows[0])]
  if differ:
    raise ValueError(f"host(s) {differ} run a different {what} from host 0: {fix}")


def agree_on(description: Any, meshes: mesh_lib.Meshes, *, what: str, fix: str) -> None:
  """Every host hashes `repr(description)`; a ValueError names the hosts that differ, and `fix`."""
  everyone = mesh_lib.gather_host_values(text_fingerprint(repr(description)), meshes)
  check_all_equal(everyone, what=what, fix=fix)


def check_replicas(step: int, local_params: PyTree, meshes: mesh_lib.Meshes,
                   what: str = "parameters") -> None:
  """Compares every host's fingerprint of `local_params` (every host must call it)."""
  rows = mesh_lib.gather_host_values(params_fingerprint(local_params), meshes)
  check_fingerprints(step, rows, what=what)
