"""Running N host processes to their end: one attempt of a job, and the local launcher.

Shared by `launch/local.py`, `launch/hosts.py` (its processes are the ssh
clients) and `hetjax.testing`, so launchers and tests stop processes the
same way. A launcher told to stop passes it on: SIGINT as SIGINT (a user's
stop, exit 130), SIGTERM and SIGHUP as SIGTERM (a preemption, 75); a second
signal kills the hosts at once. Stdlib only: this module must never import JAX.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from hetjax.config import Env
# Names the launchers and tests use from here, where they always lived (noqa: public).
from hetjax.cluster.hostenv import cluster_envs, free_port  # noqa: F401
from hetjax.cluster.hostgroup import DEFAULT_GRACE_S, POLL_S, HostGroup, split_lines  # noqa: F401
from hetjax.cluster.service import ELSEWHERE, Service
from hetjax.cluster.peers import DEFAULT_HEARTBEAT_S
from hetjax.cluster.supervise import (  # noqa: F401
    PREEMPTED_EXIT, Findings, Outcome, _signal_name, check_restarts, describe, first_failure, note,
    settled_failure, supervise)

# The key under which the service's log lines reach `Findings` (hosts use their index).
SERVICE_LINES = -1
# Signals that make the launcher stop its hosts; it then exits 128 + signum.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What the hosts receive: a Ctrl-C stays a Ctrl-C; a hang-up is a stop like SIGTERM.
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
             signal.SIGHUP: signal.SIGTERM}


class ServiceNotStarted(RuntimeError):
  """A coordination service run elsewhere did not listen (the message says why)."""


def run_group(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
              sink: IO[str] | None = None, timeout_s: float | None = None,
              grace_s: float = DEFAULT_GRACE_S, handle_signals: bool = False,
              service: tuple[str, int] | None = None,
              service_command: Sequence[str] | None = None) -> Outcome:
  """Runs one process per host until all exit 0, one fails, a deadline or a signal; then
  stops the others and kills every host's process group before returning the `Outcome`.

  `handle_signals` (main thread only) stops the hosts on SIGINT / SIGTERM / SIGHUP instead
  of orphaning them. `service` (address, heartbeat seconds) runs the coordination service
  here, so host 0's death aborts no one (None, or no jaxlib: host 0 runs it);
  `service_command` runs it elsewhere (`service.remote_argv`), and raises
  ServiceNotStarted, no host started, when it does not listen.
  """
  received: list[int] = []
  previous = _install_handlers(received) if handle_signals else {}
  findings = Findings()
  beside = None
  if service is not None or service_command is not None:
    address, heartbeat_s = service or ("", 0)  # Unused by a command run elsewhere.
    beside = Service(address, len(commands), heartbeat_s, sink,
                     lambda line: findings.scan(SERVICE_LINES, line), command=service_command)
    why = beside.start()
    if why is None:
      envs = [{**env, Env.SERVICE: ELSEWHERE} for env in envs]
    elif service_command is not None:
      _restore_handlers(previous)
      raise ServiceNotStarted(why)
    else:
      beside = None
      note(f"host 0 runs the coordination service: {why}; if host 0 dies, JAX aborts the others.")
  group = HostGroup(commands, envs, sink=sink, findings=findings)
  outcome = Outcome(returncodes=[None] * len(commands))
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  try:
    group.start()
    while True:
      codes = group.poll()
      if received:
        outcome.signal = received[0]
      elif any(rc not in (None, 0) for rc in codes):
        outcome.failed_host = first_failure(group.poll(), group.exit_times())
      elif all(rc == 0 for rc in codes):
        break
      elif deadline is not None and time.monotonic() > deadline:
        outcome.timed_out = True
      if not outcome.ok:
        break
      time.sleep(POLL_S)
    if outcome.signal is not None:
      _pass_on(group, received, grace_s)
  finally:
    stopped = [i for i, rc in enumerate(group.poll()) if rc is None]
    # Runs on success too: it kills whatever the hosts left behind.
    group.stop(grace_s if outcome.signal is None else 0.0)
    if beside is not None:  # After the hosts: a host whose service vanishes is aborted.
      if beside.proc.poll() is not None and not outcome.ok:  # It ended first: JAX ended the hosts.
        outcome.service_stopped = beside.proc.returncode
      beside.stop()
    group.join_output()
    _restore_handlers(previous)
  outcome.returncodes = group.poll()
  if outcome.failed_host is not None:  # Every host's words are read now: blame settles.
    outcome.failed_host = settled_failure(outcome.returncodes, stopped, group.exit_times(),
                                          group.findings)
  outcome.tails = [group.tail(i) for i in range(len(commands))]
  outcome.unresponsive = sorted(group.findings.unresponsive)
  outcome.stalled = sorted(group.findings.stalled)
  outcome.write_failed_hosts = sorted(group.findings.write_failed)
  outcome.reactions = sorted(group.findings.reactions)
  return outcome


def _pass_on(group: HostGroup, received: list[int], grace_s: float) -> None:
  """Forwards the stop signal and waits: for Ctrl-C as long as saving takes, else `grace_s`;
  once one host ended, `grace_s` more (one in a collective with a gone peer never ends)."""
  first = received[0]
  group.forward(FORWARDED.get(first, first))
  note(f"received {_signal_name(first)}: passed {_signal_name(FORWARDED.get(first, first))} on "
       f"to the hosts and waiting for them to stop" + (" (Ctrl-C again to kill them now)"
                                                     if first == signal.SIGINT else ""))
  seen = len(received)
  limit = None if first == signal.SIGINT else time.monotonic() + grace_s
  while len(received) == seen:
    codes = group.poll()
    if all(rc is not None for rc in codes):
      return
    now = time.monotonic()
    if any(rc is not None for rc in codes):
      limit = min(limit or math.inf, now + grace_s)
    if limit is not None and now > limit:
      return
    time.sleep(POLL_S)


def launch_local(command: Sequence[str], *, hosts: int, devices_per_host: int = 1,
                 speeds: Sequence[float] | None = None, init_timeout_s: float | None = None,
                 grace_s: float = DEFAULT_GRACE_S, sink: IO[str] | None = None,
                 slowdown: str | None = None, max_restarts: int = 0,
                 max_preemptions: int | None = None,
                 device_sample_ms: float | None = None,
                 host_env: Mapping[int, Mapping[str, str]] | None = None,
                 heartbeat_timeout_s: int | None = None) -> int:
  """Runs `command` as `hosts` hosts of a localhost cluster under `supervise`; returns 0, the
  last failing host's code, or 128 + signal. Each attempt gets a fresh coordinator port and
  its own coordination service here. ValueError on a bad argument, before anything starts.
  """
  if not command:
    raise ValueError("no host command given; put it after '--', e.g. "
                     "`--hosts 2 -- hetjax train --model cnn`.")
  check_restarts(max_restarts, max_preemptions)
  emulation = {"speeds": speeds, "slowdown": slowdown, "device_sample_ms": device_sample_ms,
               "host_env": host_env, "heartbeat_timeout_s": heartbeat_timeout_s}
  cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s,
               **emulation)  # Validates everything before the first start.

  heartbeat_s = heartbeat_timeout_s or DEFAULT_HEARTBEAT_S

  def attempt(restart_count: int) -> Outcome:
    envs = cluster_envs(hosts, devices_per_host, init_timeout_s=init_timeout_s, **emulation)
    for env in envs:
      env[Env.RESTART_COUNT] = str(restart_count)
    note(f"{hosts} host(s) x {devices_per_host} device(s), coordinator "
         f"{envs[0][Env.COORDINATOR]}: {' '.join(command)}")
    for host, extra in sorted((host_env or {}).items()):
      note(f"emulated: host {host} runs with " + " ".join(f"{k}={v}" for k, v in extra.items()))
    return run_group([command] * hosts, envs, sink=sink or sys.stdout, grace_s=grace_s,
                     handle_signals=True, service=(envs[0][Env.COORDINATOR], heartbeat_s))

  try:
    return supervise(attempt, max_restarts=max_restarts, max_preemptions=max_preemptions)
  except OSError as e:
    note(f"cannot start the host command {command[0]!r}: {e}")
    return 127 if isinstance(e, FileNotFoundError) else 126


def _install_handlers(received: list[int]) -> dict[int, object]:
  if threading.current_thread() is not threading.main_thread():
    return {}

  def handler(signum, frame):
    del frame
    received.append(signum)

  return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def _restore_handlers(previous: Mapping[int, object]) -> None:
  for signum, old in previous.items():
    signal.signal(signum, old)
