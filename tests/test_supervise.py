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
