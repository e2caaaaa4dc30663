"""The cluster launchers: `launch/slurm.sbatch`, `launch/hosts.py`, `launch/k8s/`.

No cluster here, so each runs against stand-ins: SLURM's `scontrol` and
`srun` as small scripts on PATH (srun runs its tasks on this machine), ssh
as a script that drops the host and runs the remote line with `bash -c`.
What the hosts receive is then checked with `hetjax.runtime.spec_from_env`,
the function that reads it in a real job.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest

from hetjax import procs
from test_launcher import _assert_none_left, _marked, marker  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")
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
  from hetjax import runtime  # Imports JAX: only here, once the launchers ran.
  return runtime.spec_from_env(env)


# ---------------------------------------------------------------- SLURM

_FAKE_SCONTROL = """
  #!/bin/bash
  # Stand-in for scontrol: `show hostnames LIST` prints $FAKE_NODES; `requeue` is logged.
  echo "scontrol $*" >> "$FAKE_LOG"
  if [[ "$1 $2" == "show hostnames" ]]; then tr ' ' '\\n' <<< "$FAKE_NODES"; fi
"""

# Stand-in for srun: runs --ntasks copies of the command here, each with the
# rank variables SLURM gives a task, and returns the highest exit code.
_FAKE_SRUN = """
  #!/bin/bash
  n=1
  while [[ $# -gt 0 && $1 == -* ]]; do
    echo "srun-option $1" >> "$FAKE_LOG"
    if [[ $1 == --ntasks=* ]]; then n=${1#--ntasks=}; fi
    shift
  done
  pids=()
  for ((i = 0; i < n; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NTASKS=$n "$@" > "$FAKE_OUT/task-$i.txt" 2>&1 &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do wait "$pid"; r=$?; if ((r > rc)); then rc=$r; fi; done
  exit $rc
"""


@pytest.fixture
def slurm(tmp_path):
  """Runs the sbatch script as SLURM would on a 3-node job, with stand-ins on PATH."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _script(bin_dir / "scontrol", _FAKE_SCONTROL)
  _script(bin_dir / "srun", _FAKE_SRUN)
  log, out = tmp_path / "log.txt", tmp_path / "out"
  out.mkdir()

  def run(*command: str, **env: str):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
    base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log),
                FAKE_OUT=str(out), FAKE_NODES="gpu07 gpu08 gpu09", SLURM_JOB_ID="1234",
                SLURM_JOB_NODELIST="gpu[07-09]", SLURM_JOB_NUM_NODES="3",
                SLURM_CPUS_PER_TASK="16", SLURM_LOCALID="0",
                # Left over from a local run in the submitting shell: must not leak in.
                HETJAX_COORDINATOR="127.0.0.1:1", HETJAX_NUM_HOSTS="9")
    base.update(env)
    result = subprocess.run(["bash", SBATCH, *command], env=base, capture_output=True, text=True,
                            timeout=DEADLINE_S, cwd=tmp_path)
    reports = []
    for task in sorted(out.glob("task-*.txt")):
      (line,) = [l for l in task.read_text().splitlines() if l.startswith("REPORT ")]
      reports.append(json.loads(line[len("REPORT "):]))
    logged = log.read_text().splitlines() if log.exists() else []
    return result, reports, logged

  return run


def test_sbatch_is_valid_bash():
  subprocess.run(["bash", "-n", SBATCH], check=True, timeout=DEADLINE_S)


def test_sbatch_template_shape():
  text = open(SBATCH).read()
  lines = text.splitlines()
  first_code = next(i for i, l in enumerate(lines) if l.strip() and not l.startswith("#"))
  directives = [l for l in lines if l.startswith("#SBATCH")]
  # sbatch reads #SBATCH lines only before the first command.
  assert all(lines.index(d) < first_code for d in directives)
  assert any("--ntasks-per-node=1" in d for d in directives)
  assert any("--gpus-per-node=" in d for d in directives)
  banners = [l for l in lines if l.startswith("# ====") and "EDIT" in l]
  assert len(banners) == 2 and "EDIT 1/2" in banners[0] and "EDIT 2/2" in banners[1]
  assert f"PREEMPTED_EXIT={procs.PREEMPTED_EXIT} " in text


def test_sbatch_gives_every_task_the_cluster(slurm):
  result, reports, logged = slurm(sys.executable, "-c", _REPORT, "an arg", "it's")
  assert result.returncode == 0, result.stderr
  assert len(reports) == 3
  for i, report in enumerate(reports):
    env = report["env"]
    assert env["HETJAX_COORDINATOR"] == f"gpu07:{20000 + 1234 % 10000}"
    assert env["HETJAX_NUM_HOSTS"] == "3"
    assert env["HETJAX_HOST_ID"] == str(i)
    assert "SLURM_LOCALID" not in env  # Else jax.distributed narrows the task to one GPU.
    assert report["argv"] == ["an arg", "it's"]
    spec = _runtime_spec(env)
    assert (spec.coordinator, spec.num_hosts, spec.host_id) == ("gpu07:21234", 3, i)
  for option in ("--ntasks=3", "--nodes=3", "--ntasks-per-node=1", "--distribution=block",
                 "--kill-on-bad-exit=1", "--cpus-per-task=16"):
    assert f"srun-option {option}" in logged
  assert "scontrol show hostnames gpu[07-09]" in logged
  assert "coordinator gpu07:21234" in result.stderr


def test_sbatch_port_override_and_no_cpus_per_task(slurm):
  result, reports, logged = slurm(sys.executable, "-c", _REPORT, HETJAX_PORT="4242",
                                  SLURM_CPUS_PER_TASK="")
  assert result.returncode == 0, result.stderr
  assert {r["env"]["HETJAX_COORDINATOR"] for r in reports} == {"gpu07:4242"}
  assert not any("--cpus-per-task" in line for line in logged)


def test_sbatch_requeues_a_preempted_job(slurm):
  result, _, logged = slurm(sys.executable, "-c", _REPORT, FAIL=f"1={procs.PREEMPTED_EXIT}")
  assert result.returncode == procs.PREEMPTED_EXIT
  assert "scontrol requeue 1234" in logged
  assert "preempted (exit 75): requeueing job 1234" in result.stderr


def test_sbatch_passes_a_failure_on_without_requeue(slurm):
  result, _, logged = slurm(sys.executable, "-c", _REPORT, FAIL="2=3")
  assert result.returncode == 3
  assert not any("requeue" in line for line in logged)


def test_sbatch_outside_slurm_says_how_to_run_it(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  result = subprocess.run(["bash", SBATCH, "true"], env=env, capture_output=True, text=True,
                          timeout=DEADLINE_S, cwd=tmp_path)
  assert result.returncode != 0
  assert "SLURM_JOB_ID: is not set: submit this script with sbatch" in result.stderr


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
      ["--workdir", str(workdir), "--port", "4242", "--init-timeout", "9",
       "--env", "XLA_FLAGS=--a=1 --b='2'", "--env", "EMPTY="],
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
  result, _ = ssh_run(["--max-restarts", "1"], [sys.executable, "-c", code, marker, str(flag)])
  assert result.returncode == 0, result.stderr
  assert "[launcher] restart 1/1 after host 2 failed with exit code 4" in result.stderr
  _assert_none_left(marker)


def test_hosts_dry_run_prints_the_exact_commands(tmp_path):
  hostfile = tmp_path / "hosts.txt"
  hostfile.write_text(_HOSTFILE)
  result = subprocess.run(
      [sys.executable, HOSTS, "--hostfile", str(hostfile), "--dry-run", "--workdir", "/srv/het jax",
       "--port", "4242", "--", ".venv/bin/hetjax", "train", "--steps", "10"],
      capture_output=True, text=True, timeout=DEADLINE_S)
  assert result.returncode == 0, result.stderr
  env = "HETJAX_NUM_HOSTS=3 HETJAX_HOST_ID={} HETJAX_RESTART_COUNT=0 PYTHONUNBUFFERED=1"
  expected = [
      f"ssh -tt -o BatchMode=yes {host} 'cd '\"'\"'/srv/het jax'\"'\"' && exec env "
      f"HETJAX_COORDINATOR=node-a:4242 {env.format(i)} .venv/bin/hetjax train --steps 10'"
      for i, host in enumerate(["alice@node-a", "node-b", "node-c"])]
  assert result.stdout.splitlines() == expected
  # What the shell makes of it: ssh, its options, the host, one remote line.
  assert shlex.split(expected[1])[:5] == ["ssh", "-tt", "-o", "BatchMode=yes", "node-b"]


@pytest.mark.parametrize("hostfile, args, message", [
    ("# only a comment\n\n", [], "lists no hosts; write one [user@]host per line."),
    ("node-a\nnode-b 4\n", [], "line 2 of"),
    ("@node-a\n", [], "line 1 of"),
    ("-oProxyCommand=x\n", [], "is not [user@]host"),
    ("node-a\n", ["--port", "0"], "--port must be in [1, 65535], got 0."),
    ("node-a\n", ["--env", "HETJAX_HOST_ID=3"], "--env HETJAX_HOST_ID is set by the launcher"),
    ("node-a\n", ["--env", "1X=2"], "is not KEY=VALUE"),
    ("node-a\n", ["--max-restarts", "-1"], "--max-restarts must be an integer >= 0"),
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
