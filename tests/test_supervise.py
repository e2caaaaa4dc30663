"""The launcher's restart rules, on real host processes that only exit (no training)."""

from __future__ import annotations

import io
import sys

from hetjax.checkpoint import write_failed
from hetjax.cluster import procs, supervise


def test_a_host_that_could_not_write_a_checkpoint_is_not_restarted(tmp_path, capsys):
  # Each host notes its attempt, waits until both hosts of its attempt did
  # (the first to exit gets the other stopped, perhaps before it started),
  # then exits as a host whose checkpoint write failed does.
  log = tmp_path / "attempts"
  host = ("import os, sys, time\n"
          f"with open({str(log)!r}, 'a') as f:\n"
          "  f.write(os.environ['HETJAX_HOST_ID'] + ' ' + os.environ['HETJAX_RESTART_COUNT'] + '\\n')\n"
          "deadline = time.monotonic() + 120\n"
          f"while open({str(log)!r}).read().count('\\n') % 2 and time.monotonic() < deadline:\n"
          "  time.sleep(0.01)\n"
          "print('cannot write checkpoint /ckpt/4: No space left on device.', flush=True)\n"
          f"sys.exit({supervise.WRITE_FAILED_EXIT})\n")
  code = procs.launch_local([sys.executable, "-c", host], hosts=2, max_restarts=3,
                            grace_s=0.5, sink=io.StringIO())
  assert code == supervise.WRITE_FAILED_EXIT == write_failed.WRITE_FAILED_EXIT == 74
  assert sorted(log.read_text().split("\n")[:-1]) == ["0 0", "1 0"]  # One attempt, no restart.
  err = capsys.readouterr().err
  assert "could not write a checkpoint (exit code 74" in err
  assert "No space left on device" in err  # The host's own message, in its last lines.
  assert "not restarting (--max-restarts 3)" in err
  assert "restart 1/3" not in err


# ---- blame that does not depend on who ended first ----------------------------------


def _ended(codes, times, lines, stopped=()):
  """How the launcher settles a group: `codes` and `times` per host, `lines` what each printed."""
  findings = supervise.Findings()
  for host, text in lines:
    findings.scan(host, text)
  failed = supervise.settled_failure(codes, stopped, times, findings)
  outcome = procs.Outcome(list(codes), failed_host=failed, tails=[[t for h, t in lines if h == i]
                                                                   for i in range(len(codes))],
                          stalled=sorted(findings.stalled),
                          write_failed_hosts=sorted(findings.write_failed),
                          reactions=sorted(findings.reactions))
  return procs.describe(outcome).split("\n")[0], outcome.exit_code()


def test_the_launcher_names_the_same_host_whatever_order_the_hosts_end_in():
  from hetjax.cluster import ending, lost_peer, watchdog
  cases = {
      # A stall: every host names host 1 and leaves with 69.
      "stall": ([69, 69], [(0, f"{watchdog.MARKER} 1"), (1, f"{watchdog.MARKER} 1")]),
      # One host's write failed: every host names it and leaves with 74.
      "write": ([74, 74], [(0, f"{ending.MARKERS[74]} 1"), (1, f"{ending.MARKERS[74]} 1")]),
      # Host 0 killed (kill -9): host 1's collective failed because of it.
      "killed": ([-9, 1], [(1, f"{lost_peer.MARKER} 0")]),
      # Host 1 crashed on its own; host 0 failed in the collective they shared.
      "crash": ([1, 1], [(0, f"{lost_peer.MARKER} 1"), (1, "ValueError: a bug")]),
  }
  for name, (codes, lines) in cases.items():
    first_0 = _ended(codes, [1.0, 2.0], lines)
    first_1 = _ended(codes, [2.0, 1.0], lines)
    assert first_0 == first_1, name
  assert _ended(*cases["stall"][:1], [1.0, 2.0], cases["stall"][1])[0].startswith(
      "host 1 stopped making progress")
  assert _ended([74, 74], [2.0, 1.0], cases["write"][1])[0].startswith(
      "host 1 could not write a checkpoint")
  assert _ended([-9, 1], [2.0, 1.0], cases["killed"][1])[0].startswith(
      "host 0 failed with signal SIGKILL")
  assert _ended([1, 1], [2.0, 1.0], cases["crash"][1])[0].startswith("host 1 failed with exit code 1")
  # A host the launcher stopped itself (SIGTERM after the first exit) is never the one to blame.
  assert _ended([1, -15], [2.0, 1.0], [], stopped=[1])[0].startswith("host 0 failed")
