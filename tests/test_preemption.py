"""Stop signals to the hosts of a command-line run, after they joined the cluster, end to end.

`launch/local.py ... hetjax train` on 2 hosts, as a cluster runs it. Joining
the cluster would install JAX's own SIGTERM handler (its preemption
notifier) over hetjax's, had `hetjax.initialize` not switched JAX's
preemption service off; a SIGTERM here was then logged by JAX and the job
trained on. Each test is one launcher run of two attempts (the
launcher restarts a preempted job once, `--max-preemptions 1`), so one
cluster start-up pays for two stops: SIGTERM, then Ctrl-C in the restarted
job. Each host says which step the signal reached it in, and where every
host stopped; the tests compare the two.
"""

import re
import signal

import pytest

import _cli_job

# The signal comes during step d (entered); its flag travels in step d's
# reduction, or d + 1's when it came after that step's rows were built, and
# every host acts on it two steps later: at most two whole steps after d.
MOST_STEPS_AFTER = 3
_STOP = re.compile(r"\[host (\d)\] hetjax train: (preempted|stopped)\b.*?(?:step (\d+))?[;,.]")
_DURING = re.compile(r"reached this host during step (\d+)")


def _stops(job: _cli_job.Job, start: int, end: int | None = None) -> dict[int, str]:
  """Each host's stop line between two output lines."""
  lines = job.lines[start:end]
  return {int(m.group(1)): line for line in lines if (m := _STOP.search(line))}


def _stopped_at(line: str) -> int:
  return int(re.search(r"(?:after|of) step (\d+)", line).group(1))


def _check_one_boundary(stops: dict[int, str], signalled: list[int]) -> int:
  """Every host stopped at one step, within MOST_STEPS_AFTER of each signalled host's step."""
  assert sorted(stops) == [0, 1], stops
  at = {_stopped_at(line) for line in stops.values()}
  assert len(at) == 1, stops
  step = at.pop()
  for h in signalled:
    during = int(_DURING.search(stops[h]).group(1))
    assert during < step <= during + MOST_STEPS_AFTER, stops[h]
  return step


def test_sync_sigterm_to_one_host_saves_and_resumes_then_ctrl_c_to_every_host(tmp_path):
  ckpt = tmp_path / "ckpt"
  job = _cli_job.Job(["--max-preemptions", "1"], _cli_job.train_command(
      tmp_path / "run", "--ckpt-dir", str(ckpt), "--ckpt-every", "100000"))
  try:
    signalled_at = job.wait_for_step(8)
    job.signal_hosts([1], signal.SIGTERM)
    found, resumed_line = job.wait_for(r"\[host 0\] hetjax: resumed from \S+/(\d+) ", signalled_at)
    first = _check_one_boundary(_stops(job, signalled_at, resumed_line), [1])
    assert "exit code 75" in job.text(signalled_at) and "preemption restart 1/1" in job.text()
    assert int(found.group(1)) == first  # The restarted job resumes where every host stopped.
    again = job.wait_for_step(first + 3, resumed_line)
    job.signal_hosts([0, 1], signal.SIGINT)
    assert job.finish() == 130
  finally:
    job.kill()
  stops = _stops(job, again)
  second = _check_one_boundary(stops, [0, 1])
  assert all("checkpoint saved in" in line for line in stops.values()), stops
  assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())[-1] == second


def test_hybrid_sigterm_to_every_host_without_checkpoints_then_ctrl_c_to_one(tmp_path):
  job = _cli_job.Job(["--max-preemptions", "1"],
                     _cli_job.train_command(tmp_path / "run", mode="hybrid"))
  try:
    signalled_at = job.wait_for_step(6)
    job.signal_hosts([0, 1], signal.SIGTERM)
    _, restarted = job.wait_for(r"\[launcher\] preemption restart 1/1", signalled_at)
    stops = _stops(job, signalled_at, restarted)
    _check_one_boundary(stops, [0, 1])
    assert all("nothing was saved (no --ckpt-dir), exiting with code 75" in line
               for line in stops.values()), stops
    again = job.wait_for_step(4, restarted)  # Restarted from round 0: there was no checkpoint.
    job.signal_hosts([0], signal.SIGINT)
    assert job.finish() == 130
  finally:
    job.kill()
  stops = _stops(job, again)
  _check_one_boundary(stops, [0])
  assert all("nothing was saved" in line for line in stops.values()), stops


if __name__ == "__main__":
  pytest.main([__file__, "-x", "-q"])
