"""A stand-in for SLURM's `srun` that behaves as the real one does.

Only for what one machine cannot show (a user's own srun keeping every GPU
of a node: tests/test_cluster_launchers.py); the templates run on a real
localhost SLURM in tests/test_slurm_cluster.py. What the real srun does and
this reproduces:
  - runs `--ntasks` tasks, each with the step's variables (SLURM_PROCID,
    SLURM_LOCALID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST, ...);
  - a signal to srun reaches every process of every task (slurmstepd signals
    the step's whole container, not one pid);
  - with --kill-on-bad-exit=1, the first task to exit non-zero gets the
    others SIGKILLed;
  - its exit code is the highest of the tasks' codes, a task killed by a
    signal counting as 128 + signal;
  - when srun itself dies, its tasks die (the step ends), every process of
    them: slurmstepd, not srun, holds the step's processes, which a
    guardian process stands in for here.
Each task's output goes to $FAKE_OUT/task-<group>-<rank>.txt, and a file
$FAKE_OUT/ended-<group>-<rank> appears when a task has ended (for tests that
order events); the options srun got go to $FAKE_LOG.
"""

from __future__ import annotations

import os
import stat
import sys

SRUN = r'''#!{python}
import ctypes, os, signal, subprocess, sys, time
GUARD = """
import os, signal, sys, time
srun = int(sys.argv[1])
while os.getppid() == srun:  # Reparented once srun has exited, however it ended.
  time.sleep(0.05)
for group in sys.argv[2:]:
  try:
    os.killpg(int(group), signal.SIGKILL)
  except ProcessLookupError:
    pass
"""
log = open(os.environ["FAKE_LOG"], "a")
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
  option = args.pop(0)
  log.write(f"srun-option {option}\n")
  key, _, value = option.partition("=")
  opts[key] = value
log.close()
n = int(opts.get("--ntasks", os.environ.get("SLURM_NTASKS", "1")))
group = opts.get("--het-group")
nodelist = os.environ["SLURM_JOB_NODELIST" + (f"_HET_GROUP_{group}" if group else "")]
libc = ctypes.CDLL(None)
tasks = []
for rank in range(n):
  env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank),
             SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_NUM_NODES=str(n),
             SLURM_STEP_NODELIST=nodelist, SLURM_NTASKS=str(n))
  tag = f"{group or 0}-{rank}"
  out = open(os.path.join(os.environ["FAKE_OUT"], f"task-{tag}.txt"), "w")
  tasks.append((tag, subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=lambda: libc.prctl(1, signal.SIGKILL))))

# slurmstepd: when srun dies the step ends, and every process of every task
# with it (PDEATHSIG above reaches a task's first process only, e.g. a shell
# and not the host it started).
subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid())] + [str(t.pid) for _, t in tasks],
                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)

def signal_tasks(signum, frame=None):
  for _, task in tasks:
    if task.poll() is None:
      try:
        os.killpg(task.pid, signum)
      except ProcessLookupError:
        pass

for signum in (signal.SIGTERM, signal.SIGINT):
  signal.signal(signum, signal_tasks)
codes = {}
while len(codes) < len(tasks):
  for tag, task in tasks:
    if tag in codes or task.poll() is None:
      continue
    codes[tag] = task.returncode if task.returncode >= 0 else 128 - task.returncode
    open(os.path.join(os.environ["FAKE_OUT"], f"ended-{tag}"), "w").close()
    if codes[tag] != 0 and opts.get("--kill-on-bad-exit") == "1":
      signal_tasks(signal.SIGKILL)
  time.sleep(0.01)
sys.exit(max(codes.values()))
'''

def install(bin_dir) -> None:
  """Writes an executable `srun` stand-in into `bin_dir`."""
  path = os.path.join(bin_dir, "srun")
  with open(path, "w") as f:
    f.write(SRUN.replace("{python}", sys.executable))
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
