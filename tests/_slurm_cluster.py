"""A real SLURM cluster on this machine, for the tests of launch/*.sbatch.

Debian's slurm-wlm (22.05): munged, slurmctld and three slurmd, each slurmd
a node of its own (hetjax-n1..n3, all at 127.0.0.1, each with its own port,
spool and pid file), two partitions that stand for two kinds of GPU node
(a100: n1 and n2; v100: n3; no GPUs) and a third, `all`. Everything lives in one temporary folder and runs
with this folder's SLURM_CONF in its environment: the daemons, the
slurmstepd they start, the jobs' processes. That is how `stop` finds and
kills every process of the cluster, also after a failed test.

Two settings of the machine are needed, and said when missing: the SLURM
and munge programs (`apt-get install slurmctld slurmd slurm-client munge`,
the README's test command does it as root), and the node names resolving to
127.0.0.1 (the coordinator is `hetjax-n1:PORT`, as on a cluster), which
`start` adds to /etc/hosts when it may write there.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Callable

NODES = ("hetjax-n1", "hetjax-n2", "hetjax-n3")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "sinfo",
            "squeue")
INSTALL = ("apt-get install -y slurmctld slurmd slurm-client munge  (Debian/Ubuntu, as root; "
           "the README's test command does it)")
HOSTS_LINE = "127.0.0.1 " + " ".join(NODES) + "  # hetjax tests: a localhost SLURM cluster"
DEADLINE_S = 120.0  # Only a broken cluster or job waits this long.



def missing_programs() -> list[str]:
  """The SLURM and munge programs that are not on PATH (nor in /usr/sbin)."""
  path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin"
  return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _config(base: str, ctl_port: int, node_ports: dict[str, int]) -> str:
  lines = [
      "ClusterName=hetjaxtest", f"SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctl_port}",
      # A requeued job waits cred_expire + 1 s before it starts again (SLURM's
      # default 120 s): slurmd refuses its revoked credential until then.
      "AuthType=auth/munge", "CredType=cred/munge",
      f"AuthInfo=socket={base}/munge.sock,cred_expire=10",
      "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={base}/state",
      f"SlurmdSpoolDir={base}/spool/%n", f"SlurmctldPidFile={base}/slurmctld.pid",
      f"SlurmdPidFile={base}/slurmd-%n.pid", f"SlurmctldLogFile={base}/slurmctld.log",
      f"SlurmdLogFile={base}/slurmd-%n.log",
      # No cgroups in a container: processes tracked by parentage, tasks unbound.
      "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
      "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
      "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
      # Heterogeneous jobs are scheduled by backfill only.
      "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=1,bf_interval=1",
      # The nodes' CPUs and GPUs are what this file says, not what the machine has.
      "SlurmdParameters=config_overrides", "MpiDefault=none", "ReturnToService=2",
      "MinJobAge=600", "InactiveLimit=0", "KillWait=30",
  ]
  for node, port in node_ports.items():
    lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} "
                 "CPUs=4 RealMemory=1000 State=UNKNOWN")
  lines += ["PartitionName=a100 Nodes=hetjax-n[1-2] Default=YES MaxTime=INFINITE State=UP",
            "PartitionName=v100 Nodes=hetjax-n3 MaxTime=INFINITE State=UP",
            "PartitionName=all Nodes=hetjax-n[1-3] MaxTime=INFINITE State=UP"]
  return "\n".join(lines) + "\n"


def job_fields(line: str) -> dict[str, str]:
  """`scontrol show job -o` output (one line) as a dict."""
  return dict(m.groups() for m in re.finditer(r"(\w+(?::\w+)?)=(\S*)", line))


class LocalSlurm:
  """munged, slurmctld and three slurmd in one temporary folder; `stop` ends them all."""

  def __init__(self):
    self.base = tempfile.mkdtemp(prefix="hetjax-slurm-")
    self.conf = os.path.join(self.base, "slurm.conf")
    self._daemons: list[subprocess.Popen] = []

  # ---------------------------------------------------------------- the cluster

  def env(self, **extra: str) -> dict[str, str]:
    """The environment of a SLURM client of this cluster (and of everything it starts)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "HETJAX_"))}
    env.update(SLURM_CONF=self.conf, PATH=env.get("PATH", "") + os.pathsep + "/usr/sbin")
    env.update(extra)
    return env

  def start(self) -> "LocalSlurm":
    """Starts the daemons and waits until the three nodes are idle; stops them if that fails."""
    try:
      self._start()
    except BaseException:
      self.stop()
      raise
    return self

  def _start(self) -> None:
    _check_node_names()
    for sub in ("state", *(f"spool/{n}" for n in NODES)):
      os.makedirs(os.path.join(self.base, sub))
    key = os.path.join(self.base, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
      f.write(os.urandom(1024))
    with open(self.conf, "w") as f:
      f.write(_config(self.base, _free_port(), {n: _free_port() for n in NODES}))
    b = self.base
    self._daemon("munged", ["munged", "-F", "--force", f"--socket={b}/munge.sock",
                            f"--key-file={key}", f"--pid-file={b}/munged.pid",
                            f"--log-file={b}/munged.log", f"--seed-file={b}/munged.seed"])
    self._wait_for(lambda: os.path.exists(f"{b}/munge.sock"), "munged's socket")
    self._daemon("slurmctld", ["slurmctld", "-D", "-f", self.conf])
    for node in NODES:
      self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.conf])
    self._wait_for(self._nodes_idle, "three idle nodes (sinfo)")

  def _daemon(self, name: str, argv: list[str]) -> None:
    log = open(os.path.join(self.base, f"{name}.out"), "w")
    argv[0] = shutil.which(argv[0], path=self.env()["PATH"]) or argv[0]
    self._daemons.append(subprocess.Popen(argv, env=self.env(), stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))

  def _nodes_idle(self) -> bool:
    result = self.run(["sinfo", "-h", "-N", "-p", "all", "-o", "%N %T"], check=False)
    states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
    return all(states.get(n) == "idle" for n in NODES)

  def _wait_for(self, ready: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while not ready():
      for daemon in self._daemons:
        if daemon.poll() is not None:
          raise AssertionError(f"{daemon.args[0]} exited with {daemon.returncode} while waiting "
                               f"for {what}:\n{self.logs()}")
      if time.monotonic() > deadline:
        raise AssertionError(f"no {what} after {deadline_s:g} s:\n{self.logs()}")
      time.sleep(0.2)

  def logs(self, tail: int = 15) -> str:
    """The last lines of every daemon's log, for a failure's message."""
    parts = []
    for name in sorted(os.listdir(self.base)):
      if name.endswith((".log", ".out")):
        with open(os.path.join(self.base, name), errors="replace") as f:
          lines = f.read().splitlines()[-tail:]
        parts.append(f"== {name}\n" + "\n".join(lines))
    return "\n".join(parts)

  def stop(self) -> None:
    """Ends every job, daemon and process of this cluster, then removes its folder."""
    if self._daemons and all(d.poll() is None for d in self._daemons[:2]):
      self.run(["scancel", "--full", "--user=root"], check=False)
    for daemon in reversed(self._daemons):
      if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
    for daemon in reversed(self._daemons):
      try:
        daemon.wait(timeout=10)
      except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    for pid in self.pids():
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    shutil.rmtree(self.base, ignore_errors=True)

  def pids(self, *entries: str) -> list[int]:
    """Every running process that carries this cluster's SLURM_CONF (jobs, slurmstepd).

    `entries`: more `KEY=VALUE` the process's environment must hold too.
    """
    markers = [f"SLURM_CONF={self.conf}".encode(), *(e.encode() for e in entries)]
    found = []
    for entry in os.listdir("/proc"):
      if not entry.isdigit() or int(entry) == os.getpid():
        continue
      try:
        with open(f"/proc/{entry}/environ", "rb") as f:
          environ = f.read().split(b"\0")
        if all(m in environ for m in markers):
          found.append(int(entry))
      except OSError:
        continue  # Gone, or not ours to read.
    return found

  # ---------------------------------------------------------------- jobs

  def run(self, argv: list[str], check: bool = True, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=self.env(**env), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
      raise AssertionError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
    return result

  def sbatch(self, options: list[str], script: str, command: list[str], cwd: str,
             **env: str) -> int:
    """Submits `script` with `options` before it and `command` after; returns the job id."""
    result = subprocess.run(["sbatch", "--parsable", *options, script, *command], cwd=cwd,
                            env=self.env(**env), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"sbatch failed: {result.stderr}"
    return int(result.stdout.strip().split(";")[0])

  def job(self, job_id: int) -> dict[str, str]:
    """The job's fields (the first component's, for a heterogeneous job)."""
    result = self.run(["scontrol", "show", "job", "-o", str(job_id)])
    return job_fields(result.stdout.splitlines()[0])

  def wait_job(self, job_id: int, done: Callable[[dict[str, str]], bool], what: str,
               log: str | None = None, deadline_s: float = DEADLINE_S) -> dict[str, str]:
    """Polls the job until `done(fields)`; fails naming `what`, with the job's log."""
    deadline = time.monotonic() + deadline_s
    while True:
      fields = self.job(job_id)
      if done(fields):
        return fields
      if time.monotonic() > deadline:
        text = open(log).read()[-4000:] if log and os.path.exists(log) else ""
        raise AssertionError(f"job {job_id} never {what} in {deadline_s:g} s: {fields}\n{text}\n"
                             f"{self.logs()}")
      time.sleep(0.2)

  def start_requeued_hetjob(self, job_id: int) -> None:
    """Starts a requeued heterogeneous job once it is eligible again.

    On this idle cluster the backfill scheduler (the only one that starts
    heterogeneous jobs) tries again only after some change of state, which
    a busy cluster has all the time: an update of the job's start time, made
    once SLURM's own hold (cred_expire + 1 s) has passed, is that change.
    """
    fields = self.wait_job(job_id, lambda f: f["JobState"] == "PENDING" and f["Restarts"] != "0",
                           "requeued")
    eligible = datetime.datetime.strptime(fields["EligibleTime"], "%Y-%m-%dT%H:%M:%S")
    while datetime.datetime.now() < eligible + datetime.timedelta(seconds=1):
      time.sleep(0.2)
    self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])

  def wait_ended(self, job_id: int, log: str | None = None) -> dict[str, str]:
    """Waits until the job ended and every one of its processes is gone."""
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return self.wait_job(job_id, lambda f: f["JobState"] in ended and "COMPLETING" not in
                         f.get("Reason", "") and not self._completing(job_id), "ended", log)

  def _completing(self, job_id: int) -> bool:
    result = self.run(["squeue", "-h", "-j", str(job_id), "-t", "CG", "-o", "%i"], check=False)
    return bool(result.stdout.strip())


def _check_node_names() -> None:
  """The node names must resolve to 127.0.0.1: adds them to /etc/hosts when it can."""
  def resolved() -> bool:
    try:
      return all(socket.gethostbyname(n) == "127.0.0.1" for n in NODES)
    except OSError:
      return False

  if resolved():
    return
  try:
    with open("/etc/hosts", "a") as f:
      f.write("\n" + HOSTS_LINE + "\n")
  except OSError as e:
    raise AssertionError(f"the SLURM tests' node names {NODES} do not resolve to 127.0.0.1 and "
                         f"/etc/hosts is not writable ({e.strerror}); add this line to it: "
                         f"{HOSTS_LINE!r}") from None
  assert resolved(), f"added {HOSTS_LINE!r} to /etc/hosts, yet the names do not resolve"
