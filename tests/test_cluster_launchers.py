"""The cluster launchers: `launch/slurm*.sbatch`, `launch/hosts.py`, `launch/k8s/`.

No cluster here, so each runs against stand-ins: SLURM's `scontrol` and
`srun` as small scripts on PATH that behave as the real ones do (see
tests/_slurm_standins.py; srun runs its tasks on this machine), ssh as a
script that drops the host and runs the remote line with `bash -c`. What the
hosts receive is then checked with `hetjax.cluster.runtime.resolve`, the function that
reads it in a real job. Nothing here has run on a real cluster.
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
from hetjax.cluster import procs
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


def _runtime_resolve(env: dict):
  from hetjax.cluster import runtime
  return runtime.resolve(env)


# ---------------------------------------------------------------- SLURM

# Two ways to describe the same kind of job to the stand-ins: a plain 3-node
# job, and a heterogeneous job of 2 A100 nodes + 1 V100 node.
PLAIN_JOB = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_NUM_NODES": "3",
             "SLURM_CPUS_PER_TASK": "16", "FAKE_NODES": "gpu07 gpu08 gpu09"}
HET_JOB = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST": "a100-[1-2]",
           "SLURM_JOB_NUM_NODES": "2",  # As SLURM sets it: component 0 only.
           "SLURM_JOB_NODELIST_HET_GROUP_0": "a100-[1-2]", "SLURM_JOB_NUM_NODES_HET_GROUP_0": "2",
           "SLURM_CPUS_PER_TASK_HET_GROUP_0": "32",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "v100-1", "SLURM_JOB_NUM_NODES_HET_GROUP_1": "1",
           "SLURM_CPUS_PER_TASK_HET_GROUP_1": "16", "FAKE_NODES": "a100-1 a100-2"}


@pytest.fixture
def slurm(tmp_path):
  """Runs an sbatch script as SLURM would, with stand-in srun / scontrol on PATH.

  Returns run(script, job, *command, **env) -> (result, reports by host id, log lines).
  """
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  _slurm_standins.install(str(bin_dir))
  log, out = tmp_path / "log.txt", tmp_path / "out"
  out.mkdir()

  def environment(job: dict, env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
    base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(log),
                FAKE_OUT=str(out), SLURM_JOB_ID="1234", SLURM_LOCALID="0",
                # Left over from a local run in the submitting shell: must not leak in.
                HETJAX_COORDINATOR="127.0.0.1:1", HETJAX_NUM_HOSTS="9")
    base.update(job)
    base.update(env)
    return base

  def collect(result):
    reports = {}
    for task in sorted(out.glob("task-*.txt")):
      for line in task.read_text().splitlines():
        if line.startswith("REPORT "):
          report = json.loads(line[len("REPORT "):])
          reports[int(report["env"]["HETJAX_HOST_ID"])] = report
    logged = log.read_text().splitlines() if log.exists() else []
    return result, reports, logged

  def run(script: str, job: dict, *command: str, **env: str):
    result = subprocess.run(["bash", script, *command], env=environment(job, env),
                            capture_output=True, text=True, timeout=DEADLINE_S, cwd=tmp_path)
    return collect(result)

  def start(script: str, job: dict, *command: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", script, *command], env=environment(job, env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)

  run.start, run.collect, run.out = start, collect, out
  return run


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
  for needed in ("--signal=TERM@300", "--open-mode=append", "--requeue", "--ntasks-per-node=1"):
    assert needed in options, needed
  # --signal without B: the hosts get SIGTERM, not the batch shell.
  assert not any(o.startswith("--signal=B:") for o in options)
  banners = [l for l in text.splitlines() if l.startswith("# ====") and "EDIT" in l]
  assert len(banners) == 2 and "EDIT 1/2" in banners[0] and "EDIT 2/2" in banners[1]
  assert f"PREEMPTED_EXIT={procs.PREEMPTED_EXIT} " in text


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


def test_sbatch_gives_every_task_the_cluster(slurm):
  result, reports, logged = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", _REPORT, "an arg", "it's")
  assert result.returncode == 0, result.stderr
  assert sorted(reports) == [0, 1, 2]
  for i, report in reports.items():
    env = report["env"]
    assert env["HETJAX_COORDINATOR"] == f"gpu07:{20000 + 1234 % 10000}"
    assert env["HETJAX_NUM_HOSTS"] == "3" and env["HETJAX_RESTART_COUNT"] == "0"
    assert report["argv"] == ["an arg", "it's"]
    spec = _runtime_resolve(env)
    # Explicit settings: JAX's SLURM detection stays off, every GPU visible.
    assert (spec.coordinator, spec.num_hosts, spec.host_id) == ("gpu07:21234", 3, i)
    assert spec.detect is None and spec.local_device_ids is None
  for option in ("--ntasks=3", "--nodes=3", "--ntasks-per-node=1", "--distribution=block",
                 "--kill-on-bad-exit=1", "--cpus-per-task=16"):
    assert f"srun-option {option}" in logged
  assert not any("--het-group" in line for line in logged)
  assert "scontrol show hostnames gpu[07-09]" in logged
  assert "coordinator gpu07:21234" in result.stderr


def test_hetjob_numbers_hosts_across_components(slurm):
  result, reports, logged = slurm(HETJOB, HET_JOB, sys.executable, "-c", _REPORT)
  assert result.returncode == 0, result.stderr
  assert sorted(reports) == [0, 1, 2]
  groups = {i: r["env"]["SLURM_STEP_NODELIST"] for i, r in reports.items()}
  assert groups == {0: "a100-[1-2]", 1: "a100-[1-2]", 2: "v100-1"}
  for i, report in reports.items():
    spec = _runtime_resolve(report["env"])
    assert (spec.coordinator, spec.num_hosts, spec.host_id) == ("a100-1:21234", 3, i)
  for option in ("--het-group=0", "--het-group=1", "--nodes=2", "--nodes=1", "--ntasks=2",
                 "--ntasks=1", "--cpus-per-task=32", "--cpus-per-task=16"):
    assert f"srun-option {option}" in logged
  assert "3 host(s) in 2 component(s) (2 1)" in result.stderr


def test_sbatch_port_override_and_no_cpus_per_task(slurm):
  result, reports, logged = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", _REPORT,
                                  HETJAX_PORT="4242", SLURM_CPUS_PER_TASK="")
  assert result.returncode == 0, result.stderr
  assert {r["env"]["HETJAX_COORDINATOR"] for r in reports.values()} == {"gpu07:4242"}
  assert not any("--cpus-per-task" in line for line in logged)


# A host that exits as a hetjax host would after saving on a preemption (75):
# host 1 at once; host 0 only once srun has seen host 1's task end, the moment
# when a srun with --kill-on-bad-exit kills peers whose task exited non-zero.
_PREEMPTED_ONE_AFTER_THE_OTHER = textwrap.dedent("""
  import os, sys, time
  host, out = os.environ["HETJAX_HOST_ID"], os.environ["FAKE_OUT"]
  print("REPORT " + __import__("json").dumps({"env": dict(os.environ), "argv": [], "cwd": ""}),
        flush=True)
  if host == "0":
    while not os.path.exists(os.path.join(out, "ended-0-1")):
      time.sleep(0.01)
    open(os.path.join(out, "host-0-saved"), "w").close()
  sys.exit(75)
""")


@pytest.mark.parametrize("script, job", [(SBATCH, PLAIN_JOB), (HETJOB, HET_JOB)])
def test_a_preempted_job_requeues_even_when_hosts_end_apart(slurm, script, job):
  result, _, logged = slurm(script, job, sys.executable, "-c", _PREEMPTED_ONE_AFTER_THE_OTHER)
  assert result.returncode == procs.PREEMPTED_EXIT, result.stderr
  assert (slurm.out / "host-0-saved").exists()  # Not killed by --kill-on-bad-exit.
  assert "scontrol requeue 1234" in logged
  assert "preempted: host 0 saved a checkpoint; requeueing job 1234 to resume (requeue 1/20)" in (
      result.stderr)
  assert not list(slurm.out.parent.glob(".hetjax-preempted-*"))  # The marker is consumed.


def test_requeues_stop_at_the_cap(slurm):
  result, _, logged = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", _REPORT,
                            FAIL="0=75,1=75,2=75", SLURM_RESTART_COUNT="3", HETJAX_MAX_REQUEUES="3")
  assert result.returncode == procs.PREEMPTED_EXIT
  assert not any("requeue" in line for line in logged)
  assert "after 3 requeue(s): not requeueing again (HETJAX_MAX_REQUEUES=3)" in result.stderr


def test_a_requeued_job_gets_a_new_port_and_its_restart_count(slurm):
  result, reports, _ = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", _REPORT,
                             SLURM_RESTART_COUNT="2")
  assert result.returncode == 0, result.stderr
  assert {r["env"]["HETJAX_COORDINATOR"] for r in reports.values()} == {"gpu07:21236"}
  assert {r["env"]["HETJAX_RESTART_COUNT"] for r in reports.values()} == {"2"}


def test_a_stale_marker_from_an_earlier_run_is_ignored(slurm, tmp_path):
  (tmp_path / ".hetjax-preempted-1234").write_text("")
  result, _, logged = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", _REPORT, FAIL="2=3")
  assert result.returncode != 0
  assert not any("requeue" in line for line in logged)


def test_a_failure_is_not_requeued_and_srun_kills_the_peers(slurm, marker):
  code = _REPORT.replace("sys.exit(", "import time\nif host != '2': time.sleep(120)\nsys.exit(")
  result, reports, logged = slurm(SBATCH, PLAIN_JOB, sys.executable, "-c", code, marker,
                                  FAIL="2=3")
  assert result.returncode == 128 + signal.SIGKILL  # srun: the highest code, a killed peer's.
  assert not any("requeue" in line for line in logged)
  assert "failed: srun exit code 137 (no requeue)" in result.stderr
  assert 2 in reports  # The failing host ran (a peer may be killed before it reports).
  _assert_none_left(marker)  # The sleeping peers were killed, not left behind.


def test_a_failing_component_of_a_hetjob_takes_the_others_down(slurm, marker):
  code = _REPORT.replace("sys.exit(", "import time\nif host != '2': time.sleep(120)\nsys.exit(")
  result, reports, logged = slurm(HETJOB, HET_JOB, sys.executable, "-c", code, marker,
                                  FAIL="2=3")
  assert result.returncode != 0
  assert not any("requeue" in line for line in logged)
  # The failing component's host ran, and no host outlived the job: the
  # failing component took the sleeping others down.
  assert 2 in reports
  _assert_none_left(marker)


# Waits for SIGTERM (what --signal=TERM@300, or the time limit, delivers), then
# saves and exits 75 as a hetjax host does.
_SAVES_ON_SIGTERM = textwrap.dedent("""
  import os, signal, sys, time
  def preempted(signum, frame):
    print("got SIGTERM, saving", flush=True)
    sys.exit(75)
  signal.signal(signal.SIGTERM, preempted)
  open(os.path.join(os.environ["FAKE_OUT"], "up-" + os.environ["HETJAX_HOST_ID"]), "w").close()
  time.sleep(120)
""")


def test_sigterm_to_the_whole_job_saves_and_requeues(slurm):
  job = slurm.start(SBATCH, PLAIN_JOB, sys.executable, "-c", _SAVES_ON_SIGTERM)
  try:
    deadline = time.monotonic() + DEADLINE_S
    while len(list(slurm.out.glob("up-*"))) < 3:
      assert job.poll() is None and time.monotonic() < deadline, job.communicate()
      time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)  # The batch shell and srun; srun passes it to the tasks.
    _, err = job.communicate(timeout=DEADLINE_S)
  finally:
    if job.poll() is None:
      try:
        os.killpg(job.pid, signal.SIGKILL)
      except ProcessLookupError:  # It ended between the poll and the kill.
        pass
  result, _, logged = slurm.collect(subprocess.CompletedProcess(job.args, job.returncode, "", err))
  assert job.returncode == procs.PREEMPTED_EXIT, err
  assert "SIGTERM: waiting for the hosts to save and stop" in err
  assert "scontrol requeue 1234" in logged


def test_sbatch_outside_slurm_says_how_to_run_it(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  for script in (SBATCH, HETJOB):
    result = subprocess.run(["bash", script, "true"], env=env, capture_output=True, text=True,
                            timeout=DEADLINE_S, cwd=tmp_path)
    assert result.returncode != 0
    assert "SLURM_JOB_ID: is not set: submit this script with sbatch" in result.stderr


def test_a_users_own_srun_keeps_every_device_and_finds_the_cluster(slurm, tmp_path):
  """`srun hetjax ...` without the template: the runtime reads the step itself."""
  code = textwrap.dedent("""
    import json, jax, hetjax
    topo = hetjax.initialize()
    print("REPORT " + json.dumps({"env": {"HETJAX_HOST_ID": str(topo.host_id)},
          "argv": [topo.num_hosts, topo.local_devices, jax.config.values["jax_cuda_visible_devices"]],
          "cwd": ""}), flush=True)
  """)
  port = str(procs.free_port())
  bin_dir = tmp_path / "bin"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
  env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", FAKE_LOG=str(tmp_path / "log"),
             FAKE_OUT=str(slurm.out), SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="localhost",
             HETJAX_PORT=port, HETJAX_CPU_DEVICES="2", HETJAX_INIT_TIMEOUT="60")
  result = subprocess.run(["srun", "--ntasks=2", sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
  _, reports, _ = slurm.collect(result)
  assert result.returncode == 0, [p.read_text()[-2000:] for p in slurm.out.glob("task-*")]
  # Two hosts, each with both of its devices; JAX's SLURM detection would have
  # narrowed each task to the GPU numbered SLURM_LOCALID.
  assert {i: r["argv"] for i, r in reports.items()} == {0: [2, 2, "all"], 1: [2, 2, "all"]}


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
