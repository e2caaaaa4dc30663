"""A surviving host says a peer's loss in one line; the traceback goes to a file under --out."""

import subprocess
import sys

from hetjax.cluster import lost_peer
from hetjax.cluster.positions import Position


def _gloo_error():
  try:
    raise RuntimeError("Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:534] "
                       "Connection closed by peer [127.0.0.1]:41234\nand 30 more lines")
  except RuntimeError as e:
    return e


def test_a_peers_loss_that_jax_raised_as_a_value_error_is_told_from_a_settings_error():
  """Reading an array whose collective failed raises the XLA status as a ValueError (seen
  when host 0 was killed mid-save under load): it is a peer's loss, a setting's error is not."""
  raised = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/"
                      "pair.cc:547] Connection closed by peer [127.0.0.1]:10385")
  assert lost_peer.is_peer_failure_raised_as_value_error(raised)
  for setting in ("global_batch 7 is unavailable on 2 hosts", "UNKNOWN: model 'x'",
                  "gloo interface eth9 is not a network interface of this machine"):
    assert not lost_peer.is_peer_failure_raised_as_value_error(ValueError(setting)), setting


def test_a_peers_loss_is_one_line_naming_the_host_and_the_step(tmp_path):
  error = _gloo_error()
  assert lost_peer.is_peer_failure(error) and not lost_peer.is_peer_failure(ValueError("a bug"))
  line, marker = lost_peer.explain(error, 1, 2, Position(40, 412, True), str(tmp_path),
                                   service_alive=lambda: False)
  assert line.startswith("host 0 stopped responding at step 412 (the coordination service it "
                         "runs is gone): this host's collective failed (Gloo AllGather failed: ")
  assert f"full traceback in {tmp_path}/host1-error.log" in line and "\n" not in line
  assert "Traceback (most recent call last)" in (tmp_path / "host1-error.log").read_text()
  assert marker == f"{lost_peer.MARKER} 0"
  # Host 0 lost host 2 of 3 (its service answers): it cannot tell which, and says so.
  line, marker = lost_peer.explain(error, 0, 3, Position(9, 7, True, "evaluation"), None,
                                   service_alive=lambda: True, unit="round")
  assert line.startswith("another host stopped responding in evaluation at round 7: ")
  assert "no folder to keep the traceback in" in line and marker.endswith("unknown")


_FATAL_REPORT = (
    b"step 3\rstep 4\r\n"
    b"W1205 20:50:02.727115     335 preemption_sync_manager.cc:147] Failed to retrieve\n"
    b"E1205 20:50:02.727197     335 coordination_service_agent.cc:288] Polled an error; "
    b"The following tasks are unhealthy (stopped sending heartbeats):\n1\n"
    b"F1205 20:50:02.727201     335 client.h:86] Terminating process because the JAX distributed "
    b"service detected fatal errors. This most likely indicates that another task died\n"
    b"while calling /xla.coordination.CoordinationService/PollForError:\n"
    b":UNAVAILABLE:Stream removed (Socket closed)\n"
    b"*** Check failure stack trace: ***\n    @     0x7f4362f901b4  absl::LogMessage::Flush()\n"
    b"Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n  File \"x.py\"\n")


def test_jaxs_abort_is_one_line_and_its_report_goes_to_the_error_log(tmp_path):
  """The relay a multi-host `hetjax train` pipes its stderr through (`abort_report`): what comes
  before JAX's fatal line passes (a native warning too, once no fatal line followed it), the
  report from the native lines before the fatal one goes to the file, the host says one line,
  and the list of dead hosts still reaches the launcher."""
  from hetjax.cluster import abort_report
  log = tmp_path / "out" / "host1-error.log"
  quiet = subprocess.run([sys.executable, "-I", abort_report.__file__, str(log)], check=True,
                         input=b"W1205 20:50:02.7 335 a.cc:1] only a warning\nbye\n",
                         capture_output=True)
  assert quiet.stdout == b"W1205 20:50:02.7 335 a.cc:1] only a warning\nbye\n" and not log.exists()
  run = subprocess.run([sys.executable, "-I", abort_report.__file__, str(log)], check=True,
                       input=_FATAL_REPORT, capture_output=True)
  listing = _FATAL_REPORT.split(b"\n")[2] + b"\n1\n"  # The E line that lists them, then host 1.
  assert run.stdout == b"step 3\rstep 4\r\n" + listing + (
      "hetjax: error: JAX ended this host: the coordination service is gone (UNAVAILABLE:Stream "
      f"removed (Socket closed)); full report in {log}. Under --max-restarts the launcher "
      "restarts the job from its last checkpoint.\n").encode()
  assert log.read_bytes() == _FATAL_REPORT[len(b"step 3\rstep 4\r\n"):]
