"""Joining the cluster: `jax.distributed`, CPU collectives, topology.

`resolve` decides without JAX, in docs/cluster.md's order: arguments,
HETJAX_*, a SLURM srun step of several tasks, Open MPI, a Kubernetes Indexed
Job (refused without `kubernetes` and HETJAX_*: never trained alone), Cloud
TPU, else one host. Where hetjax knows the host count and id, JAX's cluster
detection is off: it would narrow a process to one GPU, and a hetjax host
drives every GPU of its node. JAX aborts a host that cannot register, so the
others first probe the coordinator's port and raise a `ConnectionError`
naming it. JAX's preemption service stays off: its notifier would take
SIGTERM from `signals`. HETJAX_SERVICE=launcher: host 0 is a client (`service`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import socket
import sys
import time
from typing import Mapping

import jax

from hetjax.config import Env
from hetjax.cluster import service
from hetjax.cluster.peers import heartbeat_s as heartbeat_from_env
from hetjax import phases


DEFAULT_TIMEOUT_S = 120.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """How to join; None fields are JAX's to detect (`detect`: "ompi" fills only the
  coordinator, "auto" everything). `source` names the settings' origin for the join message.
  """

  coordinator: str | None
  num_hosts: int | None
  host_id: int | None
  timeout_s: float = DEFAULT_TIMEOUT_S
  local_device_ids: tuple[int, ...] | None = None
  detect: str | None = None
  source: str = ""


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where this process sits, once the runtime is up."""

  host_id: int
  num_hosts: int
  local_devices: int
  platform: str


def spec_from_env(env: Mapping[str, str] = os.environ) -> ClusterSpec | None:
  """Reads the HETJAX_* variables; `None` when they name no cluster."""
  coordinator = env.get(Env.COORDINATOR)
  if not coordinator:
    if env.get(Env.NUM_HOSTS, "").strip() == "1":
      return ClusterSpec(None, 1, 0, _env_timeout(env), source=f"{Env.NUM_HOSTS}=1")
    return None
  missing = [k for k in (Env.NUM_HOSTS, Env.HOST_ID) if not env.get(k)]
  if missing:
    raise ValueError(f"{Env.COORDINATOR}={coordinator!r} is set but {', '.join(missing)} "
                     "is not; set all three or none.")
  return ClusterSpec(coordinator, _env_int(env, Env.NUM_HOSTS), _env_int(env, Env.HOST_ID),
                     _env_timeout(env), source="HETJAX_* variables")


def _env_int(env: Mapping[str, str], key: str) -> int:
  try:
    return int(env[key])
  except ValueError:
    raise ValueError(f"{key}={env[key]!r} is not a whole number.") from None


def _env_timeout(env: Mapping[str, str]) -> float:
  raw = env.get(Env.INIT_TIMEOUT)
  try:
    return float(raw) if raw else DEFAULT_TIMEOUT_S
  except ValueError:
    raise ValueError(f"{Env.INIT_TIMEOUT}={raw!r} is not a number of seconds.") from None


def first_slurm_node(nodelist: str) -> str:
  """`gpu[07-09,12],cpu1` -> `gpu07`; `rack[1-2]-n[01-04]` -> `rack1-n01`, as scontrol would."""
  first, depth, out = True, 0, []
  for ch in nodelist.strip():
    if ch == "[":
      depth, first = depth + 1, True
    elif ch == "]":
      depth -= 1
    elif depth == 0 and ch == ",":
      break
    elif depth:
      if ch in ",-":
        first = False
      elif first:
        out.append(ch)
    else:
      out.append(ch)
  if not out or depth:
    raise ValueError(f"cannot read the first node of the SLURM node list {nodelist!r}.")
  return "".join(out)


def _slurm_spec(env: Mapping[str, str], timeout_s: float) -> ClusterSpec:
  job = env["SLURM_JOB_ID"]
  tasks = env.get("SLURM_STEP_NUM_TASKS")
  if not tasks or int(tasks) <= 1:
    why = "an srun step of one task" if tasks else "no srun step (salloc, or a batch script)"
    return ClusterSpec(None, 1, 0, timeout_s, source=f"SLURM job {job} with {why}: one host")
  nodes = int(env.get("SLURM_STEP_NUM_NODES") or tasks)
  port = env.get(Env.PORT) or env.get("JAX_COORDINATOR_PORT") or str(20000 + int(job) % 10000)
  coordinator = f"{first_slurm_node(env['SLURM_STEP_NODELIST'])}:{port}"
  one_per_node = int(tasks) == nodes
  local = None if one_per_node else (int(env["SLURM_LOCALID"]),)
  return ClusterSpec(coordinator, int(tasks), int(env["SLURM_PROCID"]), timeout_s,
                     local_device_ids=local,
                     source=f"SLURM job {job}, srun step of {tasks} tasks on {nodes} nodes"
                            + ("" if one_per_node else ": one GPU per task (SLURM_LOCALID)"))


def _ompi_spec(env: Mapping[str, str], timeout_s: float) -> ClusterSpec:
  size = int(env["OMPI_COMM_WORLD_SIZE"])
  if size <= 1:
    return ClusterSpec(None, 1, 0, timeout_s, source="Open MPI with one process: one host")
  local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
  local = None if local_size == 1 else (int(env["OMPI_COMM_WORLD_LOCAL_RANK"]),)
  return ClusterSpec(None, size, int(env["OMPI_COMM_WORLD_RANK"]), timeout_s,
                     local_device_ids=local, detect="ompi",
                     source=f"Open MPI, {size} processes"
                            + ("" if local is None else ": one GPU per process (local rank)"))


def _k8s_spec(env: Mapping[str, str], timeout_s: float) -> ClusterSpec:
  index = env["JOB_COMPLETION_INDEX"]
  if importlib.util.find_spec("kubernetes") is None:
    raise ValueError(
        f"this pod is pod {index} of an Indexed Job, but {Env.COORDINATOR} is not set and JAX "
        "cannot find the other pods without the `kubernetes` package. Set HETJAX_COORDINATOR, "
        "HETJAX_NUM_HOSTS and HETJAX_HOST_ID as launch/k8s/hetjax-job.yaml does (or "
        f"{Env.NUM_HOSTS}=1 for a job of one pod), or install jax[k8s] and give the pod's "
        "service account permission to read its Job.")
  return ClusterSpec(None, None, None, timeout_s, detect="auto",
                     source=f"Kubernetes Indexed Job (pod {index}), detected by JAX")


def resolve(env: Mapping[str, str] = os.environ, coordinator: str | None = None,
            num_hosts: int | None = None, host_id: int | None = None,
            timeout_s: float | None = None) -> ClusterSpec:
  """How this process joins (module docstring); ValueError names contradicting settings."""
  timeout = timeout_s or _env_timeout(env)
  if coordinator is not None or num_hosts is not None or host_id is not None:
    if num_hosts == 1 and coordinator is None:
      spec = ClusterSpec(None, 1, host_id or 0, timeout, source="arguments: one host")
    else:
      missing = [n for n, v in (("coordinator", coordinator), ("num_hosts", num_hosts),
                                ("host_id", host_id)) if v is None]
      if missing:
        raise ValueError(f"initialize() got some cluster settings but not {', '.join(missing)}; "
                         "give coordinator, num_hosts and host_id together (or none of them).")
      spec = ClusterSpec(coordinator, num_hosts, host_id, timeout, source="arguments")
  elif (from_env := spec_from_env(env)) is not None:
    spec = dataclasses.replace(from_env, timeout_s=timeout_s or from_env.timeout_s)
  elif "SLURM_JOB_ID" in env:
    spec = _slurm_spec(env, timeout)
  elif "OMPI_COMM_WORLD_SIZE" in env:
    spec = _ompi_spec(env, timeout)
  elif "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
    spec = _k8s_spec(env, timeout)
  elif "TPU_WORKER_HOSTNAMES" in env:
    spec = ClusterSpec(None, None, None, timeout, detect="auto", source="Cloud TPU, detected by JAX")
  else:
    spec = ClusterSpec(None, 1, 0, timeout, source="one host")
  _validate(spec)
  return spec


def split_address(address: str) -> tuple[str, int]:
  """`host:port` or `[v6 address]:port` as (host, port); raises ValueError naming the fix."""
  match = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\]:(\d+)|([^:\[\]]+):(\d+)", address.strip())
  if match is None:
    hint = (" (an IPv6 address goes in brackets: [fe80::1]:1234)" if address.count(":") > 1
            and not address.startswith("[") else "")
    raise ValueError(f"coordinator must be host:port, got {address!r}{hint}.")
  host, port = (match.group(1), match.group(2)) if match.group(1) else (match.group(3), match.group(4))
  if not 1 <= int(port) <= 65535:
    raise ValueError(f"the coordinator port must be in [1, 65535], got {port} in {address!r}.")
  return host, int(port)


def _validate(spec: ClusterSpec) -> None:
  if spec.num_hosts is not None and spec.num_hosts < 1:
    raise ValueError(f"num_hosts must be >= 1, got {spec.num_hosts}.")
  if spec.host_id is not None and spec.num_hosts is not None and not 0 <= spec.host_id < spec.num_hosts:
    raise ValueError(f"host_id must be in [0, {spec.num_hosts}), got {spec.host_id}.")
  if spec.coordinator is not None:
    split_address(spec.coordinator)
  if spec.timeout_s <= 0:
    raise ValueError(f"timeout_s must be > 0, got {spec.timeout_s}.")


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Blocks until `address` accepts TCP connections; raises after `timeout_s`."""
  host, port = split_address(address)
  deadline = time.monotonic() + timeout_s
  last_error: OSError | None = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
        return
    except OSError as e:
      last_error = e
      time.sleep(0.2)
  raise ConnectionError(
      f"Could not reach the hetjax coordinator at {address} within {timeout_s:g} s "
      f"(last error: {last_error}). Check that host 0 is running and that the address "
      f"and port are right, or raise the limit with {Env.INIT_TIMEOUT} or the config key init-timeout.")


def _use_gloo_interface(interface: str) -> None:
  """Binds gloo to `interface`: JAX uses `gethostname()`, which a `127.0.1.1` hosts entry or
  several networks resolve wrongly for peers (pytorch/gloo #223), and has no setting for it.
  """
  from jax._src import xla_bridge  # JAX's CPU client with given collectives: BUILD_NOTES.
  from jaxlib import _jax
  collectives = _jax.make_gloo_tcp_collectives(distributed_client=service.client(),
                                               interface=interface)
  from jax.extend import backend
  try:
    backend.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
        priority=0, fail_quietly=False)
  except RuntimeError:  # The CPU backend exists already.
    raise RuntimeError(f"{Env.GLOO_INTERFACE} must be set before JAX starts a backend.") from None


def configure_cpu(devices_per_host: int | None) -> None:
  """Gloo CPU collectives and optional emulated devices; before the first backend exists."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if devices_per_host is not None:
    if devices_per_host < 1:
      raise ValueError(f"devices per host must be >= 1, got {devices_per_host}.")
    jax.config.update("jax_num_cpu_devices", devices_per_host)


def is_initialized() -> bool:
  """Whether this process already joined a multi-host runtime."""
  return jax.distributed.is_initialized()


def initialize(coordinator: str | None = None, num_hosts: int | None = None,
               host_id: int | None = None, *, timeout_s: float | None = None,
               cpu_devices: int | None = None, gloo_interface: str | None = None) -> Topology:
  """Joins the cluster (or stays a single host) and returns the topology.

  Args:
    coordinator: `host:port` (or `[v6 address]:port`) of host 0's coordinator.
    num_hosts: number of processes in the job.
    host_id: this process's index in `[0, num_hosts)`.
    timeout_s: bound on reaching the coordinator and on registration.
    cpu_devices: emulated CPU devices for this host (CPU emulation only);
      defaults to HETJAX_CPU_DEVICES.
    gloo_interface: network interface for the CPU collectives (e.g. `eth0`);
      defaults to HETJAX_GLOO_INTERFACE, else the address of the hostname.

  Returns:
    The `Topology` of this process.

  Example:
    >>> topo = hetjax.initialize()   # One host here; a launcher's HETJAX_* variables join many.
    >>> topo.host_id < topo.num_hosts
    True
  """
  env_devices = os.environ.get(Env.CPU_DEVICES)
  configure_cpu(cpu_devices if cpu_devices is not None else
                (int(env_devices) if env_devices else None))
  spec = resolve(os.environ, coordinator, num_hosts, host_id, timeout_s)
  heartbeat_s = heartbeat_from_env()
  interface = gloo_interface or os.environ.get(Env.GLOO_INTERFACE) or None
  names = sorted(n for _, n in socket.if_nameindex()) if interface else []
  if interface and interface not in names:
    raise ValueError(f"{Env.GLOO_INTERFACE}={interface!r} is no network interface of this "
                     f"machine ({socket.gethostname()}); it has {', '.join(names)}.")
  if spec.num_hosts == 1 or is_initialized():
    if spec.source.startswith(("SLURM", "Open MPI", "Kubernetes")):
      _say(f"{spec.source}")
    return topology()

  jax.config.update("jax_enable_preemption_service", False)
  with phases.within(phases.JOINING):
    if spec.detect is None:
      # A launcher runs this job's coordination service: host 0 must not start one.
      client_only = spec.host_id == 0 and os.environ.get(Env.SERVICE) == service.ELSEWHERE
      if spec.host_id != 0 or client_only:
        wait_for_coordinator(spec.coordinator, spec.timeout_s)
      _say(f"host {spec.host_id} of {spec.num_hosts} joining coordinator {spec.coordinator} "
           f"({spec.source}), timeout {spec.timeout_s:g} s")
      # A loopback coordinator should not listen on every interface of the machine. Where the
      # launcher runs the service, host 0's own (JAX starts one in process 0 whatever it is
      # told) listens on a free loopback port that no host looks for.
      local = split_address(spec.coordinator)[0] in _LOOPBACK
      bind = "127.0.0.1:0" if client_only else spec.coordinator if local else None
      jax.distributed.initialize(
          coordinator_address=spec.coordinator, num_processes=spec.num_hosts,
          process_id=spec.host_id, local_device_ids=spec.local_device_ids,
          cluster_detection_method="deactivate",
          initialization_timeout=max(1, int(spec.timeout_s)),
          coordinator_bind_address=bind, heartbeat_timeout_seconds=heartbeat_s)
    else:
      # Open MPI: JAX reads the coordinator from Open MPI; [] keeps every GPU (not the local rank's).
      _say(f"joining the cluster that JAX detects ({spec.source}), timeout {spec.timeout_s:g} s")
      jax.distributed.initialize(
          num_processes=spec.num_hosts, process_id=spec.host_id,
          local_device_ids=list(spec.local_device_ids or []) if spec.detect == "ompi" else None,
          cluster_detection_method=spec.detect if spec.detect == "ompi" else None,
          initialization_timeout=max(1, int(spec.timeout_s)), heartbeat_timeout_seconds=heartbeat_s)
  if interface:
    _use_gloo_interface(interface)
  if spec.detect is not None:
    _say(f"joined as host {jax.process_index()} of {jax.process_count()}")
  # Found from SLURM, Open MPI or JAX: written down as a launcher would have, so
  # code that reads the HETJAX_* variables sees the same cluster.
  os.environ.setdefault(Env.NUM_HOSTS, str(jax.process_count()))
  os.environ.setdefault(Env.HOST_ID, str(jax.process_index()))
  return topology()


def _say(message: str) -> None:
  print(f"[hetjax] {message}", file=sys.stderr, flush=True)


def topology() -> Topology:
  """The current process's place in the (already initialised) cluster.

  Returns:
    `Topology(host_id, num_hosts, local_devices, platform)`.

  Example:
    >>> hetjax.topology().num_hosts >= 1
    True
  """
  return Topology(jax.process_index(), jax.process_count(), jax.local_device_count(),
                  jax.devices()[0].platform)
