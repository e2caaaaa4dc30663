"""Runs a hetjax job over ssh, process i on line i of a host file (stdlib only).

    .venv/bin/python launch/hosts.py --hostfile hosts.txt --workdir /shared/hetjax \\
        -- .venv/bin/hetjax train --model resnet18 --global-batch 512

The host file names one host per line as `name` or `user@name`, optionally
followed by that host's own settings, `KEY=VALUE` words (quoted like a shell
word when a value has spaces): environment variables for that host only, and
`workdir=DIR` for a checkout in another place. `#` starts a comment. Mixed
machines need this: another network interface, another CUDA setting.

    # hosts.txt
    alice@h100-a  NCCL_SOCKET_IFNAME=ib0  HETJAX_GLOO_INTERFACE=ib0   # process 0
    a100-b        NCCL_SOCKET_IFNAME=eth0 HETJAX_GLOO_INTERFACE=eth0
    v100-c        NCCL_SOCKET_IFNAME=eth0 HETJAX_GLOO_INTERFACE=eth0 workdir=/opt/hetjax

The first host runs process 0 and the coordinator, at `name:PORT` (`--port`,
default 29517; `--coordinator HOST[:PORT]` when the other hosts know host 0
by another name than the one ssh uses). Restart k of the job uses PORT + k,
as the last coordinator's port may still be held.

Every host gets, inside its remote command, HETJAX_COORDINATOR,
HETJAX_NUM_HOSTS, HETJAX_HOST_ID (and HETJAX_INIT_TIMEOUT,
HETJAX_HEARTBEAT_TIMEOUT from --heartbeat-timeout, HETJAX_RESTART_COUNT,
PYTHONUNBUFFERED, any `--env KEY=VALUE`, then its own settings), runs from its
workdir, and its output comes back prefixed with `[host i] `. `--dry-run`
prints the exact ssh command of each host, in host order, and starts nothing.

The coordinator's service runs inside process 0 unless `--service-python
PYTHON` names a Python on the first host (relative to its workdir, e.g.
`.venv/bin/python`, one with hetjax and jaxlib): then it runs there in a
process of its own, started over ssh before the hosts, so that host 0's
death does not abort the others: they stop in Python and name host 0
(`hetjax.cluster.service`). A service that does not listen stops the job
before any host starts.

Stopping: when a host fails, or the launcher is interrupted or killed, the
local ssh processes end. ssh asks for a terminal (`-tt`), so a closed
connection hangs up the remote side; there a small bash wrapper turns the
hang-up (and SIGTERM) into SIGTERM for the host, which saves its checkpoint
and exits, instead of dying of SIGHUP. The host writes through a relay that
outlives the connection, so a host that is saving never fails on a write to
a dead terminal, and it never sees a terminal, so progress lines stay plain
lines. `ServerAliveInterval` ends an ssh whose peer stopped answering. The
remote hosts need bash. `--max-restarts` / `--max-preemptions` restart all
hosts as `launch/local.py` does (see `hetjax.cluster.procs.supervise`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
from typing import Callable, Mapping, Sequence

try:
  from hetjax.cluster import launcher_cli, procs
except ImportError:  # Run from a checkout without installing hetjax.
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from hetjax.cluster import launcher_cli, procs
from hetjax import exits
from hetjax.cluster import service
from hetjax.config import Env

DEFAULT_PORT = 29517
# -tt: a remote terminal, so the remote side is hung up with the connection.
# BatchMode: a host without a usable key fails at once instead of waiting
# at a password prompt that nobody can answer. ServerAlive*: an ssh whose
# peer went silent ends within a minute instead of hanging the job.
DEFAULT_SSH = "ssh -tt -o BatchMode=yes -o ServerAliveInterval=15 -o ServerAliveCountMax=4"
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Set by the launcher from the host file; an --env that names one would break the cluster.
_RESERVED = (Env.COORDINATOR, Env.NUM_HOSTS, Env.HOST_ID, Env.RESTART_COUNT)
# Runs on the remote host under bash: the host in the background (job control
# on while it starts, so it keeps SIGINT; SIGHUP ignored), its output through
# a relay that survives the connection, and hang-up or SIGTERM to the wrapper
# passed on as SIGTERM, Ctrl-C as SIGINT; then the host's own exit code.
# A trapped signal cuts `wait` short (status > 128), so the wrapper waits
# again while a trap has run since its last wait: bash keeps a child's status
# for a later `wait $pid` (outside POSIX mode, hence `+o posix`) even when the
# host ended, and was reaped, while the trap still ran. Asking whether the host
# is alive instead (`kill -0`) lost that race and reported the signal (129).
_WRAPPER = ('set -m +o posix; {cd}trap "" HUP; {command} </dev/null '
            '> >(trap "" HUP INT TERM; cat || exec cat >/dev/null) 2>&1 & pid=$!; set +m; '
            'trap "hit=1; kill -TERM $pid 2>/dev/null" HUP TERM; '
            'trap "hit=1; kill -INT $pid 2>/dev/null" INT; '
            'rc=129; hit=1; while [ -n "$hit" ] && [ $rc -gt 128 ]; do '
            'hit=; wait $pid; rc=$?; done; exit $rc')


@dataclasses.dataclass(frozen=True)
class Host:
  """One line of the host file: where to ssh, and that host's own settings."""

  address: str
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  workdir: str | None = None

  @property
  def name(self) -> str:
    return self.address.rpartition("@")[2]


def parse_hostfile(text: str, source: str = "the host file") -> list[Host]:
  """The hosts of a host file, in order; raises ValueError naming the line."""
  hosts = []
  for number, raw in enumerate(text.splitlines(), start=1):
    try:
      words = shlex.split(raw, comments=True)
    except ValueError as e:
      raise ValueError(f"line {number} of {source} ({raw.strip()!r}): {e}.") from None
    if not words:
      continue
    address, settings = words[0], words[1:]
    user, at, name = address.rpartition("@")
    if not name or (at and not user) or address.startswith("-") or "=" in address:
      raise ValueError(f"line {number} of {source}: {address!r} is not [user@]host "
                       "(a name that does not start with '-').")
    env, workdir = {}, None
    for word in settings:
      key, sep, value = word.partition("=")
      if key == "workdir" and sep:
        workdir = value
        continue
      if not sep or not _ENV_KEY_RE.match(key):
        raise ValueError(f"line {number} of {source}: {word!r} is not KEY=VALUE (or workdir=DIR); "
                         "write [user@]host [KEY=VALUE ...].")
      if key in _RESERVED:
        raise ValueError(f"line {number} of {source}: {key} is set by the launcher; drop it.")
      env[key] = value
    hosts.append(Host(address, env, workdir))
  if not hosts:
    raise ValueError(f"{source} lists no hosts; write one [user@]host per line.")
  return hosts


def coordinator_address(hosts: Sequence[Host], port: int, coordinator: str | None = None,
                        restart_count: int = 0) -> str:
  """`host:port` of process 0 for restart `restart_count`: the port moves on by one per restart."""
  if not 1 <= port <= 65535:
    raise ValueError(f"--port must be in [1, 65535], got {port}.")
  host = hosts[0].name
  if coordinator:
    host, sep, given = coordinator.rpartition(":") if not coordinator.endswith("]") else (
        coordinator, "", "")
    if not sep or not given.isdigit():
      host = coordinator
    else:
      port = int(given)
  port += restart_count
  if port > 65535:
    raise ValueError(f"restart {restart_count} would use coordinator port {port} > 65535; "
                     "choose a lower --port.")
  return f"{host}:{port}"


def parse_env(items: Sequence[str]) -> dict[str, str]:
  """`KEY=VALUE` strings from --env as a dict; raises ValueError on a bad or reserved key."""
  env = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not _ENV_KEY_RE.match(key):
      raise ValueError(f"--env {item!r} is not KEY=VALUE with KEY a shell variable name.")
    if key in _RESERVED:
      raise ValueError(f"--env {key} is set by the launcher from the host file; drop it "
                       "(use --coordinator / --port for the address).")
    env[key] = value
  return env


def remote_command(command: Sequence[str], env: Mapping[str, str], workdir: str | None) -> str:
  """The line the remote login shell runs: bash with the wrapper around `env ... command`."""
  words = ["env"] + [shlex.quote(f"{k}={v}") for k, v in env.items()]
  words += [shlex.quote(word) for word in command]
  cd = f"cd {shlex.quote(workdir)} || exit 1; " if workdir else ""
  return "exec bash -c " + shlex.quote(_WRAPPER.format(cd=cd, command=" ".join(words)))


def host_commands(hosts: Sequence[Host], command: Sequence[str], *, coordinator: str,
                  ssh: str = DEFAULT_SSH, workdir: str | None = None,
                  env: Mapping[str, str] | None = None, init_timeout_s: float | None = None,
                  restart_count: int = 0, heartbeat_timeout_s: int | None = None,
                  service_elsewhere: bool = False) -> list[list[str]]:
  """The local argv (ssh, host, remote line) that starts process i on host i.

  `service_elsewhere`: the coordination service runs in a process of its
  own (`service_command`), so host 0 joins it as a client.
  """
  ssh_argv = _ssh_argv(ssh)
  commands = []
  for i, host in enumerate(hosts):
    host_env = {Env.COORDINATOR: coordinator, Env.NUM_HOSTS: str(len(hosts)),
                Env.HOST_ID: str(i), Env.RESTART_COUNT: str(restart_count),
                "PYTHONUNBUFFERED": "1"}
    if service_elsewhere:
      host_env[Env.SERVICE] = service.ELSEWHERE
    if init_timeout_s is not None:
      host_env[Env.INIT_TIMEOUT] = f"{init_timeout_s:g}"
    if heartbeat_timeout_s is not None:
      host_env[Env.HEARTBEAT_TIMEOUT] = str(heartbeat_timeout_s)
    host_env.update(env or {})
    host_env.update(host.env)
    commands.append([*ssh_argv, host.address,
                     remote_command(command, host_env, host.workdir or workdir)])
  return commands


def service_command(hosts: Sequence[Host], python: str, *, coordinator: str,
                    ssh: str = DEFAULT_SSH, workdir: str | None = None,
                    heartbeat_timeout_s: int | None = None) -> list[str]:
  """The local argv that runs the coordination service with `python` on the first host."""
  first = hosts[0]
  heartbeat_s = heartbeat_timeout_s or procs.DEFAULT_HEARTBEAT_S
  argv = service.remote_argv(python, coordinator, len(hosts), heartbeat_s)
  return [*_ssh_argv(ssh), first.address,
          remote_command(argv, {"PYTHONUNBUFFERED": "1", **first.env}, first.workdir or workdir)]


def _ssh_argv(ssh: str) -> list[str]:
  argv = shlex.split(ssh)
  if not argv:
    raise ValueError("--ssh is empty; give the ssh program, e.g. --ssh 'ssh -p 2222'.")
  return argv


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="launch/hosts.py",
      usage="%(prog)s --hostfile FILE [--workdir DIR] [--port P] [--ssh CMD] [--env K=V] "
            "[--heartbeat-timeout S] [--dry-run] [--max-restarts K] -- COMMAND ...",
      description="Run COMMAND as one hetjax host per line of FILE, over ssh.")
  parser.add_argument("--hostfile", required=True,
                      help="one [user@]host [KEY=VALUE ...] [workdir=DIR] per line; # comments")
  parser.add_argument("--workdir", default=None, help="folder to cd into on every host")
  parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                      help=f"coordinator port on the first host (default {DEFAULT_PORT})")
  parser.add_argument("--coordinator", default=None, metavar="HOST[:PORT]",
                      help="address the hosts use to reach process 0 (default: the first host)")
  parser.add_argument("--ssh", default=DEFAULT_SSH,
                      help=f"ssh program and options, split like a shell (default {DEFAULT_SSH!r})")
  parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                      help="extra environment for every host (repeatable)")
  parser.add_argument("--init-timeout", type=float, default=None,
                      help="seconds a host may take to join the cluster")
  launcher_cli.add_heartbeat_argument(parser)
  parser.add_argument("--service-python", default=None, metavar="PYTHON",
                      help="a Python with hetjax and jaxlib on the first host (relative to its "
                           "workdir): runs the coordination service there beside host 0, so "
                           "that host 0's death does not abort the others (default: inside "
                           "host 0)")
  parser.add_argument("--dry-run", action="store_true",
                      help="print each host's ssh command, one per line, and start nothing")
  launcher_cli.add_stop_arguments(
      parser, "seconds between SIGTERM and SIGKILL when stopping the ssh processes")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `argv` (default: sys.argv[1:]), runs the hosts, returns the exit code."""
  parser = _parser()
  args, command = launcher_cli.parse(parser, argv)
  try:
    if not command:
      raise ValueError("no host command given; put it after '--', e.g. "
                       "`--hostfile hosts.txt -- .venv/bin/hetjax train`.")
    try:
      with open(args.hostfile, encoding="utf-8") as f:
        hosts = parse_hostfile(f.read(), args.hostfile)
    except OSError as e:
      raise ValueError(f"cannot read --hostfile {args.hostfile!r}: {e.strerror}.") from e
    if args.init_timeout is not None and not args.init_timeout > 0:
      raise ValueError(f"--init-timeout must be > 0 seconds, got {args.init_timeout!r}.")
    coordinator_address(hosts, args.port, args.coordinator)  # Checks the port.
    extra_env = parse_env(args.env)

    def commands(restart_count: int) -> list[list[str]]:
      coordinator = coordinator_address(hosts, args.port, args.coordinator, restart_count)
      return host_commands(hosts, command, coordinator=coordinator, ssh=args.ssh,
                           workdir=args.workdir, env=extra_env,
                           init_timeout_s=args.init_timeout, restart_count=restart_count,
                           heartbeat_timeout_s=args.heartbeat_timeout,
                           service_elsewhere=args.service_python is not None)

    def service_for(restart_count: int) -> list[str] | None:
      if args.service_python is None:
        return None
      coordinator = coordinator_address(hosts, args.port, args.coordinator, restart_count)
      return service_command(hosts, args.service_python, coordinator=coordinator, ssh=args.ssh,
                             workdir=args.workdir, heartbeat_timeout_s=args.heartbeat_timeout)

    first = commands(0)
  except ValueError as e:
    parser.error(str(e))  # Exits 2 with the usage line.
  if args.dry_run:
    if args.service_python is not None:
      print("# the coordination service, started first: " + shlex.join(service_for(0)))
    for argv_i in first:
      print(shlex.join(argv_i))
    return 0
  return run(hosts, commands, port=args.port, coordinator=args.coordinator, grace_s=args.grace,
             max_restarts=args.max_restarts, max_preemptions=args.max_preemptions,
             service=service_for)


def run(hosts: Sequence[Host], commands: Callable[[int], list[list[str]]], *, port: int,
        coordinator: str | None, grace_s: float, max_restarts: int = 0,
        max_preemptions: int | None = None,
        service: Callable[[int], list[str] | None] = lambda restart_count: None) -> int:
  """Starts the ssh processes, supervised by `procs.supervise`; returns the exit code.

  `service(restart_count)`: the command that runs the coordination service
  on the first host for that attempt, or None (host 0 runs it).
  """
  names = ", ".join(f"host {i} {h.address}" for i, h in enumerate(hosts))

  def attempt(restart_count: int) -> procs.Outcome:
    address = coordinator_address(hosts, port, coordinator, restart_count)
    procs.note(f"{len(hosts)} host(s) over ssh, coordinator {address}: {names}")
    return procs.run_group(commands(restart_count), [os.environ] * len(hosts), sink=sys.stdout,
                           grace_s=grace_s, handle_signals=True,
                           service_command=service(restart_count))

  try:
    return procs.supervise(attempt, max_restarts=max_restarts, max_preemptions=max_preemptions)
  except procs.ServiceNotStarted as e:
    procs.note(f"the coordination service did not start on {hosts[0].address}: {e}; no host "
               "was started. Check --service-python (a Python with hetjax and jaxlib there, "
               "relative to its workdir; its lines above start with [service]), or drop it to "
               "let host 0 run the service.")
    return exits.FAILED_EXIT
  except OSError as e:
    procs.note(f"cannot start ssh ({commands(0)[0][0]!r}): {e}; check --ssh.")
    return 127 if isinstance(e, FileNotFoundError) else 126


if __name__ == "__main__":
  sys.exit(main())
