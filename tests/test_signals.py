"""Stop signals: SIGTERM or Ctrl-C to any host stops every host at one step boundary.

The two-host run also holds the hosts' agreement checks that stop a job and
the evaluation spread over two hosts: starting a cluster is the expensive
part on a 2-core machine, a scenario costs a fraction of it.
"""

import os
import signal

import numpy as np
import pytest

import hetjax
from hetjax.cluster import procs
from hetjax.cluster import signals
from hetjax.testing import run_hosts


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
  ckpt = tmp_path_factory.mktemp("ckpt")
  results = run_hosts("_stop_entries:stops_and_disagreements", hosts=2, args=(str(ckpt),),
                      timeout_s=600)
  return results, str(ckpt)


def test_ctrl_c_to_one_host_stops_both_at_the_same_boundary_without_checkpoints(two_hosts):
  results, _ = two_hosts
  # Host 1 got SIGINT after step 3; the flag travelled in step 3's reduction and
  # every host acts on it two steps later, whether or not its loop overlaps steps.
  for r in results:
    seen = r["sigint_host1_no_ckpt"]
    assert (seen["kind"], seen["step"], seen["directory"]) == ("Interrupted", 5, None)
    assert seen["exit_code"] == signals.INTERRUPTED_EXIT and "nothing was saved" in seen["message"]


def test_sigterm_without_checkpoints_stops_every_host_as_a_preemption(two_hosts):
  results, _ = two_hosts
  for r in results:
    seen = r["sigterm_host0_no_ckpt"]  # The same trainer, continued after the Ctrl-C stop.
    assert (seen["kind"], seen["step"], seen["exit_code"]) == ("Preempted", 8, procs.PREEMPTED_EXIT)


def test_ctrl_c_with_checkpoints_saves_the_boundary_and_says_how_to_resume(two_hosts):
  results, ckpt = two_hosts
  for r in results:
    seen = r["sigint_host0_ckpt"]
    assert (seen["kind"], seen["step"], seen["directory"]) == ("Interrupted", 6, ckpt)
    assert "run the same command to resume" in seen["message"]
    assert r["saved_steps"] == [6]


def test_a_host_whose_balancer_decides_another_split_stops_the_job_naming_it(two_hosts):
  results, _ = two_hosts
  for r in results:
    assert r["permuted"].startswith("HostsDisagree: step 8: host(s) [1] computed another split")
    assert "host 1 used (24, 40)" in r["permuted"]


def test_a_host_whose_parameters_diverge_stops_the_job_at_the_next_check(two_hosts):
  results, _ = two_hosts
  for r in results:
    # Host 1's replica perturbed after step 12, a step the check (every 2) falls on.
    assert r["perturbed_from"] == 12
    assert r["perturbed"].startswith("HostsDisagree: after step 12: host(s) [1] hold other "
                                     "parameters than host 0")


def test_a_host_with_another_model_is_refused_at_start_up(two_hosts):
  results, _ = two_hosts
  for r in results:
    assert r["other_model"].startswith("ValueError: host(s) [1] run a different model or optimizer")


def test_evaluation_spread_over_two_hosts_equals_one_host_whatever_the_weights(two_hosts):
  results, _ = two_hosts
  evaluations = [r["evaluation"] for r in results]
  assert evaluations[0]["host_ranges"] == [(0, 300), (300, 360)]
  import _stop_entries
  reference = _stop_entries.reference_eval(evaluations[0]["params"])
  for r in evaluations:
    for name in ("even", "uneven", "skewed"):
      assert r[name] == evaluations[0][name]  # Every host got the same figures.
      np.testing.assert_allclose(r[name]["loss"], reference["loss"], rtol=1e-5)
      np.testing.assert_allclose(r[name]["accuracy"], reference["accuracy"], rtol=1e-6)


# ---- One host, in this process ---------------------------------------------


def test_outside_the_step_loop_a_signal_stops_at_once_inside_it_waits_for_the_boundary():
  with signals.REQUESTS.installed(defer=False):
    with pytest.raises(signals.Preempted, match="outside the training steps; nothing was saved; "
                       "exiting with code 75"):
      os.kill(os.getpid(), signal.SIGTERM)
    with signals.REQUESTS.installed():  # What Trainer.fit does.
      os.kill(os.getpid(), signal.SIGTERM)
      assert signals.REQUESTS.code == signals.TERM  # Raised, not acted on: the boundary will.
    signals.REQUESTS.clear()
    with pytest.raises(signals.Interrupted, match="stopped by Ctrl-C outside the training steps"):
      os.kill(os.getpid(), signal.SIGINT)
  assert signals.REQUESTS.code == signals.NONE


def _saved(ckpt):
  return sorted(int(p) for p in os.listdir(ckpt) if p.isdigit())


def _one_host(directory=None):
  import _stop_entries
  hetjax.initialize()
  return _stop_entries._trainer(directory)


def test_ctrl_c_on_one_host_with_checkpoints_saves_the_boundary_and_says_how_to_resume(tmp_path):
  import _stop_entries
  tr = _one_host(str(tmp_path))
  before = signal.getsignal(signal.SIGINT)
  with pytest.raises(signals.Interrupted, match="stopped after step 4, checkpoint saved in "
                     f"{tmp_path}; run the same command to resume") as stop:
    tr.fit(until=50, on_step=_stop_entries._signal_on(0, 2, signal.SIGINT))
  assert stop.value.exit_code == 130 and _saved(tmp_path) == [4]
  assert stop.value.during == 1  # The last step the host entered when the signal came.
  # The stop leaves nothing behind: the caller's handler is back, the request is forgotten.
  assert signal.getsignal(signal.SIGINT) is before and signals.REQUESTS.code == signals.NONE
  tr.close()


def test_sigterm_on_one_host_without_checkpoints_stops_as_a_preemption_and_a_second_ctrl_c_aborts():
  import _stop_entries
  tr = _one_host()
  with pytest.raises(signals.Preempted, match="after step 3; nothing was saved") as stop:
    tr.fit(until=50, on_step=_stop_entries._signal_on(0, 1, signal.SIGTERM))
  assert stop.value.exit_code == procs.PREEMPTED_EXIT

  def twice(trainer, metrics):
    if trainer.step == 4:
      os.kill(os.getpid(), signal.SIGINT)  # Asks for a stop at the boundary...
      os.kill(os.getpid(), signal.SIGINT)  # ...and the second one interrupts at once.
  with pytest.raises(KeyboardInterrupt):
    tr.fit(until=50, on_step=twice)
  assert tr.step == 4
  signals.REQUESTS.clear()


def test_the_launchers_sigterm_while_a_stopped_host_leaves_keeps_what_it_saved(tmp_path):
  """Once one host exited 75 the launcher SIGTERMs the group: a host that stopped at the
  same boundary, saved, and is on its way out still says what it saved (the signal once
  replaced that with "stopped outside the training steps; nothing was saved")."""
  import _stop_entries
  tr = _one_host(str(tmp_path))
  with signals.REQUESTS.installed(defer=False):  # What the command line does.
    with pytest.raises(signals.Preempted, match=f"checkpoint of step 4 saved in {tmp_path}"):
      try:
        tr.fit(until=50, on_step=_stop_entries._signal_on(0, 2, signal.SIGTERM))
      finally:
        os.kill(os.getpid(), signal.SIGTERM)  # The launcher's, while the stop unwinds.
    assert _saved(tmp_path) == [4]
  with signals.REQUESTS.installed(defer=False):  # The next job's signals count again.
    with pytest.raises(signals.Preempted, match="outside the training steps"):
      os.kill(os.getpid(), signal.SIGTERM)
  signals.REQUESTS.clear()
  tr.close()
