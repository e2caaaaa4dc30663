"""A surviving host says a peer's loss in one line; the traceback goes to a file under --out."""

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
