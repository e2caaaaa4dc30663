"""launch/slurm.sbatch and launch/slurm-hetjob.sbatch on a real SLURM (tests/_slurm_cluster.py).

One localhost cluster for the module: three nodes, partitions a100 (n1, n2),
v100 (n3) and all. Each test submits a template whose EDIT 1/2 block (the
resources, which a user edits) is written for these nodes; everything below
it is the template's own. Fast checks run a small Python host that reports
what it got and exits with the code a test asks for; the hetjax checks run
`hetjax train` on 2 hosts (a tiny mlp, one CPU device each).

Needs SLURM and munge (Debian: `apt-get install slurmctld slurmd slurm-client
munge`, which the README's test command runs as root). Without them these
tests fail saying so; `-m "not slurm"` deselects them knowingly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import _slurm_cluster
from hetjax.cluster import service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = os.path.join(ROOT, "launch", "slurm.sbatch")
HETJOB = os.path.join(ROOT, "launch", "slurm-hetjob.sbatch")
BELOW_EDITS = "# ============================ below: no edits needed"
DEADLINE_S = _slurm_cluster.DEADLINE_S

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster():
  missing = _slurm_cluster.missing_programs()
  if missing:
    pytest.fail(f"SLURM is not installed here (no {', '.join(missing)}): install it with "
                f"{_slurm_cluster.INSTALL}, or deselect these tests knowingly with "
                f"-m 'not slurm'.", pytrace=False)
  slurm = _slurm_cluster.LocalSlurm().start()
  try:
    yield slurm
  finally:
    slurm.stop()


def _template(tmp_path, template: str, components: list[tuple[str, int]],
              time_limit: str = "5", warning_s: int = 60) -> str:
  """A copy of `template` with its EDIT 1/2 block written for these nodes, as a user edits it.

  `components`: (partition, nodes) per component; one for slurm.sbatch.
  """
  text = open(template).read()
  lines = text.splitlines(keepends=True)
  start = next(i for i, l in enumerate(lines) if l.startswith("# ") and "EDIT 1/2" in l)
  end = next(i for i in range(start + 1, len(lines)) if re.fullmatch(r"# =+\n", lines[i]))
  block = [f"#SBATCH --job-name=hetjax\n#SBATCH --time={time_limit}\n"
           f"#SBATCH --signal=B:USR1@{warning_s}\n#SBATCH --output=slurm-%j.out\n"
           "#SBATCH --open-mode=append\n#SBATCH --requeue\n"]
  for i, (partition, nodes) in enumerate(components):
    block.append(("#SBATCH hetjob\n" if i else "") + f"#SBATCH --partition={partition}\n"
                 f"#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n"
                 "#SBATCH --cpus-per-task=1\n")
  edited = "".join(lines[:start + 1] + block + lines[end:])
  assert edited.split(BELOW_EDITS)[1] == text.split(BELOW_EDITS)[1]
  path = tmp_path / os.path.basename(template)
  path.write_text(edited)
  return str(path)


# A host that reports what it got, then exits with EXITS[host@restart] (default
# 0); with SLEEP_UNLESS=h every other host of the first run sleeps instead, until killed.
_REPORT = textwrap.dedent("""
  import json, os, sys, time
  host, restart = os.environ["HETJAX_HOST_ID"], os.environ["HETJAX_RESTART_COUNT"]
  with open(os.path.join(os.environ["REPORT_DIR"], f"host-{host}-restart-{restart}.json"), "w") as f:
    json.dump(dict(os.environ), f)
  codes = dict(kv.split("=") for kv in os.environ.get("EXITS", "").split(",") if kv)
  code = int(codes.get(f"{host}@{restart}", 0))
  if restart == "0" and os.environ.get("SLEEP_UNLESS") not in (None, host):
    time.sleep(300)
  sys.exit(code)
""")


def _reports(folder, restart: int = 0) -> dict[int, dict]:
  found = {}
  for path in folder.glob(f"host-*-restart-{restart}.json"):
    found[int(path.name.split("-")[1])] = json.loads(path.read_text())
  return found


def _log(tmp_path, job_id: int) -> str:
  path = tmp_path / f"slurm-{job_id}.out"
  return path.read_text() if path.exists() else ""


def _report_env(tmp_path, **extra: str) -> dict[str, str]:
  reports = tmp_path / "reports"
  reports.mkdir(exist_ok=True)
  return {"REPORT_DIR": str(reports), **extra}


def _reporting_job(cluster, tmp_path, template: str, parts) -> tuple[int, dict]:
  """Submits `template` with `parts` running the host report; (job id, {host: its report})
  once the job completed, every host on its own node, in order."""
  script = _template(tmp_path, template, parts)
  job = cluster.sbatch([], script, [sys.executable, "-c", _REPORT], str(tmp_path),
                       **_report_env(tmp_path))
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), _log(tmp_path, job)
  reports = _reports(tmp_path / "reports")
  assert {h: r["SLURMD_NODENAME"] for h, r in reports.items()} == {
      0: "hetjax-n1", 1: "hetjax-n2", 2: "hetjax-n3"}
  return job, reports


def test_plain_template_runs_one_host_per_node(cluster, tmp_path):
  job, reports = _reporting_job(cluster, tmp_path, PLAIN, [("all", 3)])
  from hetjax.cluster import runtime  # Imports JAX: only once the job ran.
  for host, env in reports.items():
    spec = runtime.resolve(env)
    assert (spec.coordinator, spec.num_hosts, spec.host_id) == (
        f"hetjax-n1:{20000 + job % 10000}", 3, host)
    assert spec.detect is None and spec.local_device_ids is None  # Every GPU of the node.
    assert env["HETJAX_SERVICE"] == service.ELSEWHERE  # Host 0 joins as a client only.
  assert f"coordination service listening on hetjax-n1:{20000 + job % 10000}, beside host 0" in (
      _log(tmp_path, job))
  assert not (tmp_path / f".hetjax-{job}").exists()  # The exit codes' folder is gone.


def test_hetjob_numbers_hosts_across_partitions(cluster, tmp_path):
  job, reports = _reporting_job(cluster, tmp_path, HETJOB, [("a100", 2), ("v100", 1)])
  assert {r["HETJAX_COORDINATOR"] for r in reports.values()} == {f"hetjax-n1:{20000 + job % 10000}"}
  assert {r["HETJAX_NUM_HOSTS"] for r in reports.values()} == {"3"}
  assert "3 host(s) in 2 component(s) (2 1)" in _log(tmp_path, job)


def test_without_jaxlib_in_the_commands_python_host_0_keeps_the_service(cluster, tmp_path):
  """The batch script finds no jaxlib in the Python of the hosts' command (a bare venv): one
  line says host 0 runs the coordination service, and the job runs as without the service."""
  venv = tmp_path / "bare"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=120)
  python = str(venv / "bin" / "python")
  script = _template(tmp_path, PLAIN, [("a100", 2)])
  # HETJAX_SERVICE from the submitting shell must not reach the hosts. The
  # checkout on PYTHONPATH: the bare Python finds hetjax, but no jaxlib.
  job = cluster.sbatch([], script, [python, "-c", _REPORT], str(tmp_path),
                       **_report_env(tmp_path, HETJAX_SERVICE=service.ELSEWHERE, PYTHONPATH=ROOT))
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  log = _log(tmp_path, job)
  assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log
  said = [line for line in log.splitlines() if "coordination service" in line]
  assert said == [f"[hetjax] host 0 runs the coordination service: no jaxlib in {python}; if "
                  "host 0 dies, JAX aborts the others."], log
  reports = _reports(tmp_path / "reports")
  assert sorted(reports) == [0, 1] and not [r for r in reports.values() if "HETJAX_SERVICE" in r]


def test_a_stall_requeues_the_job_and_the_restart_gets_a_new_port(cluster, tmp_path):
  script = _template(tmp_path, PLAIN, [("a100", 2)])
  # Host 1 stalls (exit 69) while host 0 runs on: srun kills host 0, the job requeues.
  job = cluster.sbatch([], script, [sys.executable, "-c", _REPORT], str(tmp_path),
                       **_report_env(tmp_path, EXITS="1@0=69", SLEEP_UNLESS="1"))
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  log = _log(tmp_path, job)
  assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), log
  assert "host(s) 1 stopped a stuck job (exit 69, stall 1/3); requeueing job" in log
  again = _reports(tmp_path / "reports", restart=1)
  assert {r["HETJAX_COORDINATOR"] for r in again.values()} == {f"hetjax-n1:{20000 + (job + 1) % 10000}"}


def test_a_failed_write_is_never_requeued_and_takes_every_component_down(cluster, tmp_path):
  script = _template(tmp_path, HETJOB, [("a100", 2), ("v100", 1)])
  # Host 2 (component 1) cannot write its checkpoint; hosts 0 and 1 would run on.
  job = cluster.sbatch([], script, [sys.executable, "-c", _REPORT], str(tmp_path),
                       **_report_env(tmp_path, EXITS="2@0=74", SLEEP_UNLESS="2"))
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  log = _log(tmp_path, job)
  assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("FAILED", "0", "74:0"), log
  assert "host(s) 2 could not write a checkpoint (exit 74): not requeueing" in log
  reports = str(tmp_path / "reports")
  assert not [pid for pid in cluster.pids() if _env_has(pid, f"REPORT_DIR={reports}")]


def _env_has(pid: int, entry: str) -> bool:
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      return entry.encode() in f.read().split(b"\0")
  except OSError:
    return False


# ---------------------------------------------------------------- hetjax itself

def _train(out, *extra: str) -> list[str]:
  return [sys.executable, "-m", "hetjax.cli", "train", "--model", "mlp", "--dataset", "digits",
          "--global-batch", "32", "--microbatch", "4", "--log-every", "0", "--out", str(out), *extra]


def _hetjax_env(**extra: str) -> dict[str, str]:
  return {"PYTHONPATH": ROOT, "HETJAX_CPU_DEVICES": "1", "HETJAX_INIT_TIMEOUT": "120",
          "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **extra}


# Stands in for the wandb library on the hosts: each init() is one JSON line.
_FAKE_WANDB = textwrap.dedent("""
  import json, os

  class Settings:
    def __init__(self, **kwargs):
      pass

  class _Run:
    def __init__(self):
      self.summary = {}
    def log(self, values, step=None):
      pass
    def finish(self, **kwargs):
      pass

  def Image(path):
    return path

  def teardown(exit_code=None):
    pass

  def init(**kwargs):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
      f.write(json.dumps({"host": os.environ.get("HETJAX_HOST_ID"), "id": kwargs.get("id"),
                          "resume": kwargs.get("resume")}) + "\\n")
    return _Run()
""")


def _records(out) -> list[dict]:
  path = out / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(l) for l in path.read_text().splitlines() if l.endswith("}")]


def _wait_for(what: str, ready, describe, deadline_s: float = DEADLINE_S):
  """`ready()` once true; fails after `deadline_s` with `describe()` (the logs)."""
  deadline = time.monotonic() + deadline_s
  while not (found := ready()):
    assert time.monotonic() < deadline, f"no {what} in {deadline_s:g} s:\n{describe()[-8000:]}"
    time.sleep(0.2)
  return found


def test_hetjob_trains_through_a_time_limit_warning_that_saves_and_requeues_once(cluster, tmp_path):
  """The warning: every host saves, the job requeues once, resumes at the saved step, ends.

  The job asks for a warning 110 s before its limit and starts with 5 minutes;
  once it trains, the limit drops to 2 minutes, so the warning is due: SLURM
  sends it within its 30 s check. The requeued job gets its 5 minutes back
  and a config file that now ends 3 steps after the saved one; it starts
  again once SLURM's hold after a requeue (cred_expire + 1 s, 11 s here) passed.
  """
  fake = tmp_path / "fake_wandb"
  (fake / "wandb").mkdir(parents=True)
  (fake / "wandb" / "__init__.py").write_text(_FAKE_WANDB)
  inits = tmp_path / "wandb-inits.jsonl"
  config = tmp_path / "steps.yaml"
  config.write_text("steps: 100000\n")
  script = _template(tmp_path, HETJOB, [("a100", 1), ("v100", 1)], time_limit="5", warning_s=110)
  out, ckpt = tmp_path / "run", tmp_path / "ckpt"
  command = _train(out, "--config", str(config), "--ckpt-dir", str(ckpt), "--ckpt-every",
                   "100000", "--wandb", "hetjax-test")
  # Paced: 10 ms of emulated device time a sample (160 ms a step), so the hosts sleep
  # through the minute of waiting for SLURM instead of training on the suite's two
  # cores. A speed would also stretch the first step's compile (HETJAX_SPEED=0.05: 78 s).
  job = cluster.sbatch([], script, command, str(tmp_path), **_hetjax_env(
      PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", FAKE_WANDB_LOG=str(inits),
      HETJAX_DEVICE_SAMPLE_MS="10"))
  log = lambda: _log(tmp_path, job)  # noqa: E731
  described = lambda: log() + cluster.logs()  # noqa: E731

  _wait_for("training", lambda: len(_records(out)) >= 1, described)
  cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=2"])
  _wait_for("the warning", lambda: "time-limit warning (SIGUSR1)" in log(), described,
            deadline_s=90)
  cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"])  # For the requeued run.
  saved = _wait_for("checkpoint saved on the warning", lambda: re.findall(
      r"preempted: checkpoint of step (\d+) saved", log()), described)
  step = int(saved[0])
  config.write_text(f"steps: {step + 3}\n")  # Read by the requeued run, 11 s after the requeue.
  cluster.start_requeued_hetjob(job)
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), (
      log() + cluster.logs())
  assert set(saved) == {str(step)}  # Every host saved the same step.
  assert "time-limit warning (SIGUSR1): every host saves" in log()
  assert f"time-limit warning: every host saved; requeueing job {job} to resume (requeue 1/20)" in log()
  assert log().count("requeueing job") == 1
  assert re.search(rf"hetjax: resumed from \S+/{step} ", log()), log()
  summary = json.loads((out / "summary.json").read_text())
  assert (summary["hosts"], summary["resumed_from"]) == (2, step)
  assert [r["step"] for r in _records(out)] == list(range(1, step + 4))  # To the end.
  assert "2 host(s) in 2 component(s) (1 1)" in log()

  # W&B: host 0 opened one run per attempt, both the same; host 1 none.
  opened = [json.loads(l) for l in inits.read_text().splitlines()]
  assert [o["host"] for o in opened] == ["0", "0"]
  assert len({o["id"] for o in opened}) == 1 and {o["resume"] for o in opened} == {"allow"}


# Saves on SIGTERM as a hetjax host does (tests/test_preemption.py checks hetjax's own).
_SAVES_ON_SIGTERM = textwrap.dedent("""
  import os, signal, sys, time
  folder, host = os.environ["REPORT_DIR"], os.environ["HETJAX_HOST_ID"]
  def saved(signum, frame):
    open(os.path.join(folder, f"saved-{host}"), "w").close()
    sys.exit(75)
  signal.signal(signal.SIGTERM, saved)
  open(os.path.join(folder, f"up-{host}"), "w").close()
  time.sleep(300)
""")


def test_scancel_stops_the_job_after_every_host_saved_and_never_requeues(cluster, tmp_path):
  script = _template(tmp_path, PLAIN, [("a100", 2)])
  env = _report_env(tmp_path)
  job = cluster.sbatch([], script, [sys.executable, "-c", _SAVES_ON_SIGTERM], str(tmp_path), **env)
  reports = tmp_path / "reports"
  _wait_for("both hosts up", lambda: len(list(reports.glob("up-*"))) == 2,
            lambda: _log(tmp_path, job))
  cluster.run(["scancel", str(job)])
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  log = _log(tmp_path, job)
  assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), log
  assert sorted(p.name for p in reports.glob("saved-*")) == ["saved-0", "saved-1"]
  assert "stopped by SIGTERM: every host saved; not requeued by this script" in log
  assert "requeueing" not in log


# What JAX prints when it aborts a host whose coordination service is gone.
_CRASH = re.compile(r"Check fail|(^|\d: )F\d{4} |SetError|SIGABRT|Abort|Fatal|Traceback")


def _host_pid(cluster, host: int, mark: str) -> int:
  """The pid of host `host`'s `hetjax train` (not of its task's shell), in the job marked `mark`."""
  found = []
  for pid in cluster.pids(f"HETJAX_HOST_ID={host}", mark):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\0")
    except OSError:
      continue
    if argv[:3] == [sys.executable, "-m", "hetjax.cli"]:
      found.append(pid)
  assert len(found) == 1, found
  return found[0]


def test_host_0_killed_mid_training_host_1_says_so_in_one_line(cluster, tmp_path):
  """The batch script runs the coordination service beside host 0: kill -9 of host 0 leaves
  host 1 one line naming it, not JAX's abort (a C++ fatal error) nor a traceback."""
  script = _template(tmp_path, PLAIN, [("a100", 2)])
  out = tmp_path / "run"
  mark = f"HETJAX_TEST_JOB={tmp_path}"
  # Host 0 stops inside step 4 (emulated), so host 1 is waiting for it in that
  # step's collective when host 0 dies: host 1's collective fails before srun
  # reacts to host 0's exit.
  job = cluster.sbatch([], script, _train(out, "--steps", "100000"), str(tmp_path),
                       **_hetjax_env(HETJAX_TEST_JOB=str(tmp_path),
                                     HETJAX_FAULTS="0:stall-in-step@4"))
  log = lambda: _log(tmp_path, job)  # noqa: E731
  _wait_for("host 0 stalled", lambda: "emulated fault: host 0 stalls in" in log(),
            lambda: log() + cluster.logs())
  os.kill(_host_pid(cluster, 0, mark), signal.SIGKILL)
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  text = log()
  assert (fields["JobState"], fields["Restarts"]) == ("FAILED", "0"), text
  assert "coordination service listening on hetjax-n1:" in text, text
  host1 = [line[len("1: "):] for line in text.splitlines() if line.startswith("1: ")]
  said = [line for line in host1 if "host 0" in line]
  assert len(said) == 1 and re.match(r"hetjax train: error: host 0 stopped responding at "
                                     r"step \d+: ", said[0]), text
  assert f"full traceback in {out / 'host1-error.log'}" in said[0]
  assert not [line for line in text.splitlines() if _CRASH.search(line)], text


def test_scancel_of_hetjax_hosts_saves_while_the_service_lives_on(cluster, tmp_path):
  """`scancel` signals every process of the job, the batch script's too: the coordination
  service it runs ignores that SIGTERM and lives until the hosts saved, then stops."""
  script = _template(tmp_path, PLAIN, [("a100", 2)])
  out, ckpt = tmp_path / "run", tmp_path / "ckpt"
  job = cluster.sbatch([], script, _train(out, "--steps", "100000", "--ckpt-dir", str(ckpt),
                                          "--ckpt-every", "100000"), str(tmp_path),
                       **_hetjax_env())
  log = lambda: _log(tmp_path, job)  # noqa: E731
  _wait_for("training", lambda: len(_records(out)) >= 3, lambda: log() + cluster.logs())
  cluster.run(["scancel", str(job)])
  fields = cluster.wait_ended(job, tmp_path / f"slurm-{job}.out")
  text = log()
  assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), text
  saved = re.findall(r"^(\d): hetjax train: preempted: checkpoint of step (\d+) saved", text,
                     re.MULTILINE)
  assert sorted(h for h, _ in saved) == ["0", "1"] and len({s for _, s in saved}) == 1, text
  assert "stopped by SIGTERM: every host saved; not requeued by this script" in text
  assert not [line for line in text.splitlines() if _CRASH.search(line)], text
