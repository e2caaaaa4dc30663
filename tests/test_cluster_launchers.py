"""The cluster launchers: `launch/slurm*.sbatch`, `launch/hosts.py`, `launch/k8s/`.

The SLURM templates run on a real localhost SLURM in tests/test_slurm_cluster.py;
here are their static checks, and a stand-in `srun` (tests/_slurm_standins.py)
only for what one machine cannot show: every GPU of a node kept by a
user's own srun. ssh is a script that drops the host and runs the remote
line with `bash -c`. What the hosts receive is checked with
`hetjax.cluster.runtime.resolve`, the function that reads it in a real job.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import _slurm_standins
from hetjax import exits
from hetjax.cluster import procs, service
from hetjax.cluster.peers import DEFAULT_HEARTBEAT_S
from hetjax.config import Env
from test_launcher import _assert_none_left, _marked, marker  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")
HETJOB = os.path.join(ROOT, "launch", "slurm-hetjob.sbatch")
HOSTS = os.path.join(ROOT, "launch", "hosts.py")
K8S = os.path.join(ROOT, "launch", "k8s", "hetjax-job.yaml")
DEADLINE_S = 60

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="scans /proc for orphans")

# Prints what a host sees as one JSON line: its environment, argv and folder.
_REPORT = textwrap.dedent("""
  import json, os, sys
  print("REPORT " + json.dumps({"env": dict(os.environ), "argv": sys.argv[1:],
                                "cwd": os.getcwd()}), flush=True)
  host = os.environ.get("HETJAX_HOST_ID")
  fail = dict(kv.split("=") for kv in os.environ.get("FAIL", "").split(",") if kv)
  sys.exit(int(fail.get(host, 0)))
""")


def _script(path, text: str) -> str:
  path.write_text(textwrap.dedent(text).lstrip())
  path.chmod(path.stat().st_mode | stat.S_IXUSR)
  return str(path)


def _runtime_spec(env: dict):
  from hetjax.cluster import runtime  # Imports JAX: only here, once the launchers ran.
  return runtime.spec_from_env(env)


def _runtime_heartbeat(env: dict) -> int:
  from hetjax.cluster import runtime
  return runtime.heartbeat_from_env(env)


# ---------------------------------------------------------------- SLURM

@pytest.fixture
def standin_srun(tmp_path):
  """A stand-in srun on PATH (tests/_slurm_standins.py), for what one machine cannot show.

  Returns (bin folder, task output folder, reports(): the REPORT lines by host id).
  """
  bin_dir, out = tmp_path / "bin", tmp_path / "out"
  bin_dir.mkdir()
  out.mkdir()
  _slurm_standins.install(str(bin_dir))

  def reports() -> dict[int, dict]:
    found = {}
    for task in sorted(out.glob("task-*.txt")):
      for line in task.read_text().splitlines():
        if line.startswith("REPORT "):
          report = json.loads(line[len("REPORT "):])
          found[int(report["env"]["HETJAX_HOST_ID"])] = report
    return found

  return bin_dir, out, reports


@pytest.mark.parametrize("script", [SBATCH, HETJOB])
def test_sbatch_is_valid_bash(script):
  subprocess.run(["bash", "-n", script], check=True, timeout=DEADLINE_S)


def _directives(script: str) -> list[str]:
  lines = open(script).read().splitlines()
  first_code = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith("#"))
  directives = [l.split("#", 2)[1].strip() for l in lines if l.startswith("#SBATCH")]
  # sbatch reads #SBATCH lines only before the first command.
  assert all(i < first_code for i, l in enumerate(lines) if l.startswith("#SBATCH"))
  return [d[len("SBATCH "):].split()[0] for d in directives]


@pytest.mark.parametrize("script", [SBATCH, HETJOB])
def test_sbatch_templates_shape(script):
  text = open(script).read()
  options = _directives(script)
  for needed in ("--signal=B:USR1@300", "--open-mode=append", "--requeue", "--ntasks-per-node=1"):
    assert needed in options, needed
  # The time-limit warning goes to the batch shell only (B:), as SIGUSR1: SIGTERM means a stop.
  assert [o for o in options if o.startswith("--signal")] == ["--signal=B:USR1@300"]
  banners = [l for l in text.splitlines() if l.startswith("# ====") and "EDIT" in l]
  assert len(banners) == 2 and "EDIT 1/2" in banners[0] and "EDIT 2/2" in banners[1]
  assert f"PREEMPTED_EXIT={exits.PREEMPTED_EXIT} " in text
  assert f"STALLED_EXIT={exits.STALLED_EXIT} " in text
  assert f"WRITE_FAILED_EXIT={exits.WRITE_FAILED_EXIT} " in text
  # The coordination service beside host 0: its READY line, hetjax's heartbeat, the hosts' flag.
  assert f"DEFAULT_HEARTBEAT_S={DEFAULT_HEARTBEAT_S} " in text
  assert service.READY in text and f"export {Env.SERVICE}={service.ELSEWHERE}\n" in text


def test_hetjob_template_has_one_component_per_kind_of_node():
  options = _directives(HETJOB)
  components = " ".join(options).split("hetjob")
  assert len(components) == 2
  for component in components:
    for needed in ("--partition=", "--nodes=", "--gpus-per-node=", "--cpus-per-task="):
      assert needed in component, (needed, component)


def test_both_templates_share_the_code_below_the_edits():
  marker = "# ============================ below: no edits needed"
  plain, het = (open(s).read().split(marker, 1)[1] for s in (SBATCH, HETJOB))
  assert plain == het


def test_sbatch_outside_slurm_says_how_to_run_it(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  for script in (SBATCH, HETJOB):
    result = subprocess.run(["bash", script, "true"], env=env, capture_output=True, text=True,
                            timeout=DEADLINE_S, cwd=tmp_path)
    assert result.returncode != 0
    assert "SLURM_JOB_ID: is not set: submit this script with sbatch" in result.stderr


def test_a_users_own_srun_keeps_every_device_and_finds_the_cluster(standin_srun, tmp_path):
  """`srun hetjax ...` without the template: the runtime reads the step itself."""
  code = textwrap.dedent("""
    import json, jax, hetjax
    topo = hetjax.initialize()
    print("REPORT " + json.dumps({"env": {"HETJAX_HOST_ID": str(topo.host_id)},
          "argv": [topo.num_hosts, topo.local_devices, jax.config.values["jax_cuda_visible_devices"]],
          "cwd": ""}), flush=True)
  """)
  port = str(procs.free_port())
  bin_dir, out, reports = standin_srun
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
  env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "log"),
             FAKE_OUT=str(out), SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="localhost",
             HETJAX_PORT=port, HETJAX_CPU_DEVICES="2", HETJAX_INIT_TIMEOUT="60")
  result = subprocess.run(["srun", "--ntasks=2", sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert result.returncode == 0, [p.read_text()[-2000:] for p in out.glob("task-*")]
  # Two hosts, each with both of its devices; JAX's SLURM detection would have
  # narrowed each task to the GPU numbered SLURM_LOCALID.
  assert {i: r["argv"] for i, r in reports().items()} == {0: [2, 2, "all"], 1: [2, 2, "all"]}


# ---------------------------------------------------------------- ssh host list

_FAKE_SSH = """
  #!/bin/bash
  # Stand-in for ssh: the first word is the host, the rest is the remote line,
  # which ssh would hand to the remote login shell.
  export FAKE_SSH_HOST="$1"
  shift
  exec bash -c "$*"
"""

_HOSTFILE = """\
# the cluster; the first host is the coordinator
alice@node-a   # process 0

node-b
  node-c\t# indented, with a tab
"""


@pytest.fixture
def ssh_run(tmp_path):
  """Runs launch/hosts.py over the stand-in ssh; returns (result, reports by host)."""
  fake_ssh = _script(tmp_path / "fake-ssh", _FAKE_SSH)
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text(_HOSTFILE)

  def run(launcher_args: list[str], command: list[str], env: dict | None = None):
    result = subprocess.run(
        [sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh", fake_ssh, *launcher_args,
         "--", *command], capture_output=True, text=True, timeout=DEADLINE_S,
        env={**os.environ, **(env or {})})
    reports = {}
    for line in result.stdout.splitlines():
      assert line.startswith("[host "), line
      prefix, _, rest = line.partition("] ")
      if rest.startswith("REPORT "):
        reports[int(prefix[len("[host "):])] = json.loads(rest[len("REPORT "):])
    return result, reports

  return run


def test_hosts_env_workdir_and_quoting_arrive(ssh_run, tmp_path, marker):
  workdir = tmp_path / "work dir"
  workdir.mkdir()
  odd = "it's a \"test\" $HOME `x` ; &&"
  result, reports = ssh_run(
      ["--workdir", str(workdir), "--port", "4242", "--init-timeout", "9", "--heartbeat-timeout",
       "7", "--env", "XLA_FLAGS=--a=1 --b='2'", "--env", "EMPTY="],
      [sys.executable, "-c", _REPORT, marker, odd])
  assert result.returncode == 0, result.stderr
  assert sorted(reports) == [0, 1, 2]
  for i, host in enumerate(["alice@node-a", "node-b", "node-c"]):
    env = reports[i]["env"]
    assert env["FAKE_SSH_HOST"] == host
    assert reports[i]["cwd"] == str(workdir)
    assert reports[i]["argv"] == [marker, odd]
    assert env["XLA_FLAGS"] == "--a=1 --b='2'" and env["EMPTY"] == ""
    assert env["HETJAX_RESTART_COUNT"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    spec = _runtime_spec(env)
    assert (spec.coordinator, spec.num_hosts, spec.host_id, spec.timeout_s) == (
        "node-a:4242", 3, i, 9.0)
    assert _runtime_heartbeat(env) == 7  # --heartbeat-timeout, as the runtime reads it.
  assert "coordinator node-a:4242: host 0 alice@node-a, host 1 node-b, host 2 node-c" in (
      result.stderr)
  _assert_none_left(marker)


def test_hosts_coordinator_override(ssh_run, marker):
  result, reports = ssh_run(["--coordinator", "10.0.0.1"], [sys.executable, "-c", _REPORT, marker])
  assert result.returncode == 0, result.stderr
  assert {r["env"]["HETJAX_COORDINATOR"] for r in reports.values()} == {"10.0.0.1:29517"}


def test_hosts_failing_host_stops_the_others(ssh_run, marker):
  code = _REPORT.replace("sys.exit(", "import time\nif host != '1': time.sleep(120)\nsys.exit(")
  result, reports = ssh_run(["--grace", "0.5", "--env", "FAIL=1=3"],
                            [sys.executable, "-c", code, marker])
  assert result.returncode == 3
  assert "host 1 failed with exit code 3; stopped the other 2 hosts." in result.stderr
  assert 1 in reports
  _assert_none_left(marker)


def test_hosts_restart(ssh_run, tmp_path, marker):
  flag = tmp_path / "flag"
  code = ("import os, sys\n"
          "if os.environ['HETJAX_HOST_ID'] == '2' and not os.path.exists(sys.argv[2]):\n"
          "  open(sys.argv[2], 'w').close(); sys.exit(4)\n")
  code = _REPORT.replace("sys.exit(", "if host == '2' and not os.path.exists(sys.argv[2]):\n"
                                      "  open(sys.argv[2], 'w').close(); sys.exit(4)\nsys.exit(")
  result, _ = ssh_run(["--max-restarts", "1"], [sys.executable, "-c", code, marker, str(flag)])
  assert result.returncode == 0, result.stderr
  assert "[launcher] restart 1/1 after host 2 failed with exit code 4" in result.stderr
  # A fresh coordinator port for the restart: the old one may still be held.
  seen = [json.loads(line.split("REPORT ", 1)[1])["env"]["HETJAX_COORDINATOR"]
          for line in result.stdout.splitlines() if line.startswith("[host 2] REPORT ")]
  assert seen == ["node-a:29517", "node-a:29518"]
  _assert_none_left(marker)


def test_hosts_per_host_settings_arrive_on_their_host_only(tmp_path, marker):
  fake_ssh = _script(tmp_path / "fake-ssh", _FAKE_SSH)
  other = tmp_path / "other checkout"
  other.mkdir()
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text(f"node-a NCCL_SOCKET_IFNAME=ib0   # process 0\n"
                      f"node-b NCCL_SOCKET_IFNAME=eth0 'CUDA_NOTE=a b' workdir='{other}'\n")
  result = subprocess.run([sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh", fake_ssh,
                           "--env", "NCCL_SOCKET_IFNAME=lo", "--", sys.executable, "-c", _REPORT,
                           marker], capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 0, result.stderr
  reports = {int(l[len("[host "):].split("]")[0]): json.loads(l.split("REPORT ", 1)[1])
             for l in result.stdout.splitlines() if " REPORT " in l}
  assert reports[0]["env"]["NCCL_SOCKET_IFNAME"] == "ib0"  # The host's own setting wins.
  assert reports[1]["env"]["NCCL_SOCKET_IFNAME"] == "eth0"
  assert reports[1]["env"]["CUDA_NOTE"] == "a b" and "CUDA_NOTE" not in reports[0]["env"]
  assert reports[1]["cwd"] == str(other) and reports[0]["cwd"] != str(other)


# Reports how its signals are set up, then saves on SIGTERM as a hetjax host does.
_HOST_ON_SSH = textwrap.dedent("""
  import os, signal, sys, time
  def preempted(signum, frame):
    print("got SIGTERM, saving", flush=True)
    sys.exit(75)
  signal.signal(signal.SIGTERM, preempted)
  print("ready HUP ignored:", signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
        "INT default:", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
  time.sleep(120)
""")


# Stand-in for ssh whose wrapper forwards a signal slowly: its `kill` (a
# function, ahead of bash's builtin) returns from forwarding SIGTERM only once
# the host has ended and bash has reaped it. That is the order in which the
# wrapper used to lose the host's exit code (it asked `kill -0` whether the
# host was alive, and exited 129 for the hang-up); now it must still say 75.
_SLOW_FORWARDING_SSH = """
  #!/bin/bash
  kill() {
    builtin kill "$@"; local rc=$?
    if [ "$1" = -TERM ]; then while [ -e "/proc/$2" ]; do sleep 0.05; done; fi
    return $rc
  }
  export -f kill
  export FAKE_SSH_HOST="$1"
  shift
  exec bash -c "$*"
"""


@pytest.mark.parametrize("forwarding", ["prompt", "slow"])
def test_a_hung_up_connection_makes_the_remote_host_save(tmp_path, marker, forwarding):
  """ssh -tt hangs up the remote side when the connection closes: SIGHUP to the wrapper.

  Prompt: the host is still running when the wrapper waits again. Slow: it
  has ended, and been reaped, before the wrapper's trap returns.
  """
  fake_ssh = _script(tmp_path / "fake-ssh",
                     _FAKE_SSH if forwarding == "prompt" else _SLOW_FORWARDING_SSH)
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text("node-a\n")
  launcher = subprocess.Popen([sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh",
                               fake_ssh, "--", sys.executable, "-c", _HOST_ON_SSH, marker],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    line = launcher.stdout.readline()
    assert line == "[host 0] ready HUP ignored: True INT default: True\n", line
    # The host is the python running _HOST_ON_SSH; the wrapper is its parent.
    (host,) = [pid for pid in _marked(marker)
               if open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[1:3] == [
                   b"-c", _HOST_ON_SSH.encode()]]
    wrapper = int(open(f"/proc/{host}/stat").read().rsplit(")", 1)[1].split()[1])
    assert b"set -m" in open(f"/proc/{wrapper}/cmdline", "rb").read()
    os.kill(wrapper, signal.SIGHUP)
    out, err = launcher.communicate(timeout=DEADLINE_S)
  finally:
    launcher.kill()
  assert "[host 0] got SIGTERM, saving" in out
  assert launcher.returncode == procs.PREEMPTED_EXIT, err
  assert "host 0 was preempted (exit code 75)" in err
  _assert_none_left(marker)


def test_hosts_dry_run_prints_the_exact_commands(tmp_path):
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text(_HOSTFILE)
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(hostfile), "--dry-run", "--workdir", "/srv/het jax",
       "--port", "4242", "--", ".venv/bin/hetjax", "train", "--steps", "10"],
      capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 0, result.stderr
  ssh = ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=15", "-o",
         "ServerAliveCountMax=4"]
  lines = result.stdout.splitlines()
  assert len(lines) == 3
  for i, (line, host) in enumerate(zip(lines, ["alice@node-a", "node-b", "node-c"])):
    # What the local shell makes of it: ssh, its options, the host, one remote line;
    # what the remote login shell makes of that: bash running the wrapper.
    *local, remote = shlex.split(line)
    assert local == [*ssh, host]
    exec_, bash, dash_c, wrapper = shlex.split(remote)
    assert (exec_, bash, dash_c) == ("exec", "bash", "-c")
    assert wrapper.startswith("set -m +o posix; cd '/srv/het jax' || exit 1; ")
    assert (f"env HETJAX_COORDINATOR=node-a:4242 HETJAX_NUM_HOSTS=3 HETJAX_HOST_ID={i} "
            f"HETJAX_RESTART_COUNT=0 PYTHONUNBUFFERED=1 .venv/bin/hetjax train --steps 10 "
            f"</dev/null ") in wrapper


# A host that joins the cluster over the stand-in ssh. Host 0 leaves at once
# without JAX's shutdown, as a crashed host 0 would, but with exit code 0 so
# that the launcher waits for host 1; host 1 then asks the coordination
# service for a key and reports whether it still answered.
_OUTLIVES_HOST_0 = textwrap.dedent("""
  import json, os, time
  import hetjax
  from hetjax.cluster import service
  hetjax.initialize()
  client = service.client()
  if os.environ["HETJAX_HOST_ID"] == "0":
    client.key_value_set("pid0", str(os.getpid()))
    client.blocking_key_value_get("go", 60_000)
    os._exit(0)
  pid = int(client.blocking_key_value_get("pid0", 60_000))
  client.key_value_set("go", "1")
  def gone():
    try:
      with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
      return True
  while not gone():
    time.sleep(0.05)
  try:
    client.key_value_set("after", "1")
    answered = client.blocking_key_value_get("after", 10_000) == "1"
  except Exception:
    answered = False
  print("REPORT " + json.dumps({"service_answered": answered}), flush=True)
  os._exit(0)
""")


@pytest.mark.parametrize("beside", [True, False], ids=["service beside host 0", "inside host 0"])
def test_hosts_service_python_keeps_the_service_when_host_0_is_gone(tmp_path, beside):
  fake_ssh = _script(tmp_path / "fake-ssh", _FAKE_SSH)
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text("node-a\nnode-b\n")
  service = ["--service-python", sys.executable] if beside else []
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh", fake_ssh,
       "--coordinator", f"127.0.0.1:{procs.free_port()}", *service,
       "--", sys.executable, "-c", _OUTLIVES_HOST_0],
      capture_output=True, text=True, timeout=DEADLINE_S)
  reports = [json.loads(line.partition("REPORT ")[2]) for line in result.stdout.splitlines()
             if line.startswith("[host 1] REPORT ")]
  if beside:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert reports == [{"service_answered": True}], result.stdout[-3000:]
    assert "host 0 runs the coordination service" not in result.stderr
  else:  # The control: host 0 took the service with it (host 1 is told so, or aborted).
    assert reports in ([], [{"service_answered": False}]), result.stdout[-3000:]


def test_hosts_service_python_that_cannot_serve_stops_before_any_host(tmp_path):
  fake_ssh = _script(tmp_path / "fake-ssh", _FAKE_SSH)
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text("node-a\nnode-b\n")
  witness = tmp_path / "host-started"
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh", fake_ssh,
       "--coordinator", f"127.0.0.1:{procs.free_port()}", "--service-python", "false",
       "--", "touch", str(witness)], capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 1, result.stderr
  assert "the coordination service did not start on node-a" in result.stderr
  assert "Check --service-python" in result.stderr
  assert not witness.exists()


def test_hosts_dry_run_with_service_python_names_the_service_and_host_0_joins_it(tmp_path):
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text("node-a HETJAX_GLOO_INTERFACE=ib0\nnode-b\n")
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(hostfile), "--dry-run", "--workdir", "/srv/hetjax",
       "--port", "4242", "--heartbeat-timeout", "30", "--service-python", ".venv/bin/python",
       "--", ".venv/bin/hetjax", "train"], capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 0, result.stderr
  first, *hosts = result.stdout.splitlines()
  prefix = "# the coordination service, started first: "
  assert first.startswith(prefix)
  *local, remote = shlex.split(first[len(prefix):])
  assert local[-1] == "node-a"
  wrapper = shlex.split(remote)[3]
  assert wrapper.startswith("set -m +o posix; cd /srv/hetjax || exit 1; ")
  assert "HETJAX_GLOO_INTERFACE=ib0" in wrapper  # The first host's own settings.
  assert ".venv/bin/python -I -c" in wrapper and " node-a:4242 2 30 </dev/null" in wrapper
  assert len(hosts) == 2 and all("HETJAX_SERVICE=launcher" in line for line in hosts)


@pytest.mark.parametrize("hostfile, args, message", [
    ("# only a comment\n\n", [], "lists no hosts; write one [user@]host per line."),
    ("node-a\nnode-b 4\n", [], "line 2 of"),
    ("@node-a\n", [], "line 1 of"),
    ("-oProxyCommand=x\n", [], "is not [user@]host"),
    ("node-a\n", ["--port", "0"], "--port must be in [1, 65535], got 0."),
    ("node-a FOO\n", [], "line 1 of"),
    ("node-a HETJAX_HOST_ID=1\n", [], "HETJAX_HOST_ID is set by the launcher"),
    ("node-a 'unclosed\n", [], "line 1 of"),
    ("node-a\n", ["--env", "HETJAX_HOST_ID=3"], "--env HETJAX_HOST_ID is set by the launcher"),
    ("node-a\n", ["--env", "1X=2"], "is not KEY=VALUE"),
    ("node-a\n", ["--max-restarts", "-1"], "--max-restarts must be an integer >= 0"),
    ("node-a\n", ["--heartbeat-timeout", "0"], "--heartbeat-timeout must be a whole number of seconds >= 1"),
])
def test_hosts_bad_input_fails_before_ssh(tmp_path, hostfile, args, message):
  path = tmp_path / "hosts.txt"
  path.write_text(hostfile)
  witness = tmp_path / "started"
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(path), "--ssh", f"touch {witness}", *args,
       "--", "true"], capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 2
  assert message in result.stderr
  assert not witness.exists()


def test_hosts_missing_hostfile_and_ssh(tmp_path):
  result = subprocess.run([sys.executable, HOSTS, "--hostfile", str(tmp_path / "nope"), "--",
                           "true"], capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 2 and "cannot read --hostfile" in result.stderr
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text("node-a\n")
  result = subprocess.run([sys.executable, HOSTS, "--hostfile", str(hostfile), "--ssh",
                           str(tmp_path / "no-ssh"), "--", "true"],
                          capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 127 and "cannot start ssh" in result.stderr


# ---------------------------------------------------------------- Kubernetes

def test_k8s_manifest_matches_what_runtime_reads():
  import yaml  # The test extra installs PyYAML.
  with open(K8S) as f:
    docs = {d["kind"]: d for d in yaml.safe_load_all(f) if d}
  service, job = docs["Service"], docs["Job"]
  spec, pod = job["spec"], job["spec"]["template"]
  (container,) = pod["spec"]["containers"]
  env = {e["name"]: e for e in container["env"]}

  hosts = int(env["HETJAX_NUM_HOSTS"]["value"])
  assert spec["completionMode"] == "Indexed"
  assert spec["completions"] == spec["parallelism"] == hosts
  assert pod["spec"]["restartPolicy"] == "Never"
  # Pod i is <job>-<i>.<subdomain>; the subdomain must be the headless Service.
  assert service["spec"]["clusterIP"] == "None"
  assert pod["spec"]["subdomain"] == service["metadata"]["name"]
  assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
  (port,) = service["spec"]["ports"]
  assert env["HETJAX_COORDINATOR"]["value"] == (
      f"{job['metadata']['name']}-0.{service['metadata']['name']}:{port['port']}")
  assert env["HETJAX_HOST_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")
  assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1

  # What pod 1 sees, read by the runtime's own reader.
  seen = {name: e["value"] for name, e in env.items() if "value" in e}
  seen["HETJAX_HOST_ID"] = "1"
  spec = _runtime_spec(seen)
  assert (spec.coordinator, spec.num_hosts, spec.host_id) == ("hetjax-0.hetjax:29517", hosts, 1)
