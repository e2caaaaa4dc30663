"""Joining the cluster: `jax.distributed`, CPU collectives, topology.

Where the cluster comes from, in order of precedence:
  1. explicit arguments to `initialize`;
  2. the environment: HETJAX_COORDINATOR (host:port), HETJAX_NUM_HOSTS,
     HETJAX_HOST_ID, optionally HETJAX_INIT_TIMEOUT (seconds) and
     HETJAX_CPU_DEVICES (emulated CPU devices per host);
  3. what `jax.distributed.initialize()` detects by itself (SLURM, Open MPI,
     Kubernetes/JobSet, Cloud TPU), when such an environment is present;
  4. otherwise a single host, with no distributed runtime at all.

JAX aborts the whole process (a C++ fatal error, no Python exception) when a
host cannot register with the coordinator, so a non-coordinator host first
probes the coordinator's TCP port for a bounded time and raises a
`ConnectionError` that names the address it tried.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from typing import Mapping

import jax

ENV_COORDINATOR = "HETJAX_COORDINATOR"
ENV_NUM_HOSTS = "HETJAX_NUM_HOSTS"
ENV_HOST_ID = "HETJAX_HOST_ID"
ENV_INIT_TIMEOUT = "HETJAX_INIT_TIMEOUT"
ENV_CPU_DEVICES = "HETJAX_CPU_DEVICES"

DEFAULT_TIMEOUT_S = 120.0

# Variables whose presence means JAX can find the cluster on its own.
_AUTO_DETECT_MARKERS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME", "TPU_WORKER_HOSTNAMES")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """How to reach the coordinator; `None` fields are left to JAX's detection."""

  coordinator: str | None
  num_hosts: int | None
  host_id: int | None
  timeout_s: float = DEFAULT_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where this process sits, once the runtime is up."""

  host_id: int
  num_hosts: int
  local_devices: int
  platform: str


def spec_from_env(env: Mapping[str, str] = os.environ) -> ClusterSpec | None:
  """Reads the HETJAX_* variables; `None` when HETJAX_COORDINATOR is unset."""
  coordinator = env.get(ENV_COORDINATOR)
  if not coordinator:
    return None
  missing = [k for k in (ENV_NUM_HOSTS, ENV_HOST_ID) if not env.get(k)]
  if missing:
    raise ValueError(f"{ENV_COORDINATOR}={coordinator!r} is set but {', '.join(missing)} "
                     "is not; set all three or none.")
  return ClusterSpec(coordinator, int(env[ENV_NUM_HOSTS]), int(env[ENV_HOST_ID]),
                     float(env.get(ENV_INIT_TIMEOUT, DEFAULT_TIMEOUT_S)))


def _validate(spec: ClusterSpec) -> None:
  if spec.num_hosts is not None and spec.num_hosts < 1:
    raise ValueError(f"num_hosts must be >= 1, got {spec.num_hosts}.")
  if spec.host_id is not None and spec.num_hosts is not None and not 0 <= spec.host_id < spec.num_hosts:
    raise ValueError(f"host_id must be in [0, {spec.num_hosts}), got {spec.host_id}.")
  if spec.coordinator is not None and ":" not in spec.coordinator:
    raise ValueError(f"coordinator must be host:port, got {spec.coordinator!r}.")
  if spec.timeout_s <= 0:
    raise ValueError(f"timeout_s must be > 0, got {spec.timeout_s}.")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Blocks until `address` accepts TCP connections; raises after `timeout_s`."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout_s
  last_error: OSError | None = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
        return
    except OSError as e:
      last_error = e
      time.sleep(0.2)
  raise ConnectionError(
      f"Could not reach the hetjax coordinator at {address} within {timeout_s:g} s "
      f"(last error: {last_error}). Check that host 0 is running and that the address "
      f"and port are right, or raise the limit with {ENV_INIT_TIMEOUT} / --init-timeout.")


def configure_cpu(devices_per_host: int | None) -> None:
  """Selects gloo CPU collectives and, optionally, emulated CPU devices.

  Must run before the first JAX computation creates a backend.
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if devices_per_host is not None:
    if devices_per_host < 1:
      raise ValueError(f"devices per host must be >= 1, got {devices_per_host}.")
    jax.config.update("jax_num_cpu_devices", devices_per_host)


def is_initialized() -> bool:
  """Whether this process already joined a multi-host runtime."""
  from jax._src import distributed  # No public probe exists in JAX 0.10.
  return distributed.global_state.client is not None


def initialize(coordinator: str | None = None, num_hosts: int | None = None,
               host_id: int | None = None, *, timeout_s: float | None = None,
               cpu_devices: int | None = None) -> Topology:
  """Joins the cluster (or stays a single host) and returns the topology.

  Args:
    coordinator: `host:port` of host 0's coordinator service.
    num_hosts: number of processes in the job.
    host_id: this process's index in `[0, num_hosts)`.
    timeout_s: bound on reaching the coordinator and on registration.
    cpu_devices: emulated CPU devices for this host (CPU emulation only);
      defaults to HETJAX_CPU_DEVICES.

  Returns:
    The `Topology` of this process.
  """
  env_devices = os.environ.get(ENV_CPU_DEVICES)
  configure_cpu(cpu_devices if cpu_devices is not None else
                (int(env_devices) if env_devices else None))
  env_spec = spec_from_env()
  explicit = coordinator is not None or num_hosts is not None or host_id is not None
  if explicit:
    spec = ClusterSpec(coordinator, num_hosts, host_id,
                       timeout_s or (env_spec.timeout_s if env_spec else DEFAULT_TIMEOUT_S))
  elif env_spec is not None:
    spec = dataclasses.replace(env_spec, timeout_s=timeout_s or env_spec.timeout_s)
  elif any(m in os.environ for m in _AUTO_DETECT_MARKERS):
    spec = ClusterSpec(None, None, None, timeout_s or DEFAULT_TIMEOUT_S)
  else:
    spec = ClusterSpec(None, 1, 0, timeout_s or DEFAULT_TIMEOUT_S)
  _validate(spec)

  if spec.num_hosts != 1 and not is_initialized():
    if spec.coordinator is not None and spec.host_id not in (None, 0):
      wait_for_coordinator(spec.coordinator, spec.timeout_s)
    print(f"[hetjax] host {spec.host_id} joining coordinator {spec.coordinator or '(auto-detected)'}"
          f" of {spec.num_hosts} hosts, timeout {spec.timeout_s:g} s", file=sys.stderr, flush=True)
    # A loopback coordinator should not listen on every interface of the machine.
    local = spec.coordinator is not None and spec.coordinator.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator, num_processes=spec.num_hosts,
        process_id=spec.host_id, initialization_timeout=max(1, int(spec.timeout_s)),
        coordinator_bind_address=spec.coordinator if local else None)
  return topology()


def topology() -> Topology:
  """The current process's place in the (already initialised) cluster."""
  return Topology(jax.process_index(), jax.process_count(), jax.local_device_count(),
                  jax.devices()[0].platform)
