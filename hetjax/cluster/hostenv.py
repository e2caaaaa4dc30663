"""Each host's environment: the variables `runtime.initialize()` reads, all checked before the
first host starts (how its process runs is `hostgroup`'s job). Stdlib only: never JAX.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Sequence

from hetjax.config import Env
from hetjax.cluster import emulate


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """A launcher's `ARGS -- COMMAND...` as (launcher arguments, host command)."""
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  return argv[:split], argv[split + 1:]


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def validate_cluster(hosts: int, devices_per_host: int, speeds: Sequence[float] | None = None,
                     init_timeout_s: float | None = None) -> list[float] | None:
  """Checks the shape of a local cluster before anything starts; returns the speeds."""
  if not isinstance(hosts, int) or hosts < 1:
    raise ValueError(f"the number of hosts (--hosts) must be an integer >= 1, got {hosts!r}.")
  if not isinstance(devices_per_host, int) or devices_per_host < 1:
    raise ValueError(f"devices per host (--devices-per-host) must be an integer >= 1, "
                     f"got {devices_per_host!r}.")
  if init_timeout_s is not None and not init_timeout_s > 0:
    raise ValueError(f"the init timeout (--init-timeout) must be > 0 seconds, "
                     f"got {init_timeout_s!r}.")
  return None if speeds is None else emulate.check_speeds(speeds, hosts)


def cluster_envs(hosts: int, devices_per_host: int, *, speeds: Sequence[float] | None = None,
                 init_timeout_s: float | None = None, base: Mapping[str, str] | None = None,
                 coordinator: str | None = None, slowdown: str | None = None,
                 device_sample_ms: float | None = None,
                 host_env: Mapping[int, Mapping[str, str]] | None = None,
                 heartbeat_timeout_s: int | None = None) -> list[dict[str, str]]:
  """One complete environment per host, as `runtime.initialize()` reads it.

  `base` defaults to this process's environment, `coordinator` to a free
  port on 127.0.0.1; the emulation settings become HETJAX_SPEED,
  HETJAX_SLOWDOWN (`HOST:FACTOR@STEP,...`), HETJAX_DEVICE_SAMPLE_MS and
  `host_env` ({host: {key: value}}, e.g. another XLA_FLAGS on one host).
  """
  speeds = validate_cluster(hosts, devices_per_host, speeds, init_timeout_s)
  if heartbeat_timeout_s is not None and (not isinstance(heartbeat_timeout_s, int)
                                          or heartbeat_timeout_s < 1):
    raise ValueError(f"the heartbeat timeout (--heartbeat-timeout) must be a whole number of "
                     f"seconds >= 1, got {heartbeat_timeout_s!r}.")
  if device_sample_ms is not None:
    emulate.sample_ms_from_env({Env.DEVICE_SAMPLE_MS: str(device_sample_ms)})
  for s in emulate.parse_slowdowns(slowdown or ""):
    if s.host >= hosts:
      raise ValueError(f"--slowdown names host {s.host} but there are {hosts} hosts (0..{hosts - 1}).")
  host_env = dict(host_env or {})
  if any(not 0 <= h < hosts for h in host_env):
    raise ValueError(f"host_env names host(s) {sorted(host_env)} but there are {hosts} hosts.")
  coordinator = coordinator or f"127.0.0.1:{free_port()}"
  envs = []
  for i in range(hosts):
    env = dict(os.environ if base is None else base)
    env.update({Env.COORDINATOR: coordinator, Env.NUM_HOSTS: str(hosts), Env.HOST_ID: str(i),
                Env.CPU_DEVICES: str(devices_per_host), "PYTHONUNBUFFERED": "1"})
    if init_timeout_s is not None:
      env[Env.INIT_TIMEOUT] = f"{init_timeout_s:g}"
    if heartbeat_timeout_s is not None:
      env[Env.HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    if speeds is not None:
      env[Env.SPEED] = repr(speeds[i])
    if slowdown:
      env[Env.SLOWDOWN] = slowdown
    if device_sample_ms is not None:
      env[Env.DEVICE_SAMPLE_MS] = repr(float(device_sample_ms))
    env.update(host_env.get(i, {}))
    envs.append(env)
  return envs
