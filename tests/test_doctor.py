"""`hetjax doctor` on an emulated 3-host cluster, its preflight checks, and its input checks."""

import os
import socket
import subprocess
import sys

import pytest

from hetjax.cluster import doctor
from _doctor_entries import BATCH
from hetjax.testing import run_hosts

from _warm_client import module_command

SPEEDS = (1.0, 0.5, 0.25)
STEP_S = 1 / 64  # Every step's recorded real duration (exact in binary).


def test_doctor_on_three_emulated_hosts(tmp_path):
  path = str(tmp_path / "doctor.json")
  # A deadline, not a speed figure: 3 hosts x 2 devices compile and time on 2
  # shared cores, so it is generous.
  # The speed test times its steps on a recorded clock (every step STEP_S):
  # the figures below are exact, not a race between processes on 2 cores.
  results = run_hosts("_doctor_entries:doctor_on_every_host", hosts=3, devices_per_host=2,
                      speeds=SPEEDS, args=(path,),
                      kwargs={"expect_devices": "2", "recorded_step_s": STEP_S}, timeout_s=600)
  assert [code for code, _, _ in results] == [0, 0, 0]
  assert [text for _, text, _ in results[1:]] == ["", ""]  # Only process 0 speaks.
  _, text, report = results[0]

  assert report["ok"] and report["problems"] == []
  assert (report["num_hosts"], report["devices_per_host"]) == (3, [2, 2, 2])
  assert report["collectives"] == "gloo" and report["platform"] == "cpu"
  assert report["coordinator"].startswith("127.0.0.1:")
  # Each of the 6 device rows carries its host id + 1: 2 * (1 + 2 + 3).
  assert report["reduction"]["ok"] and report["reduction"]["got"] == report["reduction"]["expected"] == 12
  hosts = report["hosts"]
  assert [len(h["devices"]) for h in hosts] == [2, 2, 2]
  assert all(d["kind"] == "cpu" for h in hosts for d in h["devices"])
  assert len({d["id"] for h in hosts for d in h["devices"]}) == 6
  assert [h["speed"] for h in hosts] == list(SPEEDS) and all(h["emulated"] for h in hosts)

  # Each host's real figure is the host's batch over the recorded step; its
  # own pacing stretches that step by 1 / its speed, so host 2 (4x slower)
  # reports a quarter of host 0's figure, in host order.
  assert [h["real_samples_per_sec"] for h in hosts] == [BATCH / STEP_S] * 3
  assert [h["samples_per_sec"] for h in hosts] == [BATCH / STEP_S * s for s in SPEEDS]

  assert "cross-host sum: ok (got 12, expected 12" in text
  assert "emulated speed 0.25" in text and "doctor: all checks passed" in text
  assert text.count("2 x cpu") == 3
  # Preflight: every host on this machine, so a loopback hostname is fine here.
  verdicts = [p["verdict"] for p in report["preflight"]]
  assert all(p["ok"] for p in report["preflight"]), verdicts
  assert [v for v in verdicts if v.endswith("2 cpu device(s), as expected")] == [
      f"host {h}: 2 cpu device(s), as expected" for h in range(3)]
  assert sum("resolves to" in v or "does not resolve" in v for v in verdicts) == 3


def test_bad_arguments_fail_before_joining_the_cluster(capsys):
  assert doctor.main(["--batch", "0"]) == 2
  assert "--batch must be >= 1, got 0" in capsys.readouterr().err


def test_text_fields_survive_the_float32_collective():
  assert doctor.decode_text(doctor.encode_text("node-17.cluster")) == "node-17.cluster"
  assert len(doctor.encode_text("x" * 200)) == doctor.TEXT_BYTES


def test_a_failed_check_is_reported_as_a_problem():
  report = {"ok": False, "problems": ["the cross-host sum gave 11, expected 12: ..."],
            "num_hosts": 2, "devices_per_host": [1, 1], "coordinator": "10.0.0.1:1234",
            "platform": "gpu", "collectives": "gloo", "jax_version": "0.10.2",
            "reduction": {"ok": False, "got": 11.0, "expected": 12.0, "latency_ms": 0.5},
            "benchmark": {"model": "mlp", "batch": 256, "steps": 10},
            "hosts": [{"host": h, "hostname": f"n{h}", "devices": [{"id": h, "kind": "H100"}],
                       "emulated": False, "speed": 1.0, "samples_per_sec": None,
                       "real_samples_per_sec": None} for h in range(2)]}
  text = doctor.format_report(report)
  assert "cross-host sum: WRONG (got 11, expected 12" in text
  assert "not measured" in text and "1 x H100 (ids 1)" in text
  assert text.rstrip().endswith("doctor: 1 problem(s)")


def test_a_loopback_hostname_is_a_problem_only_across_machines():
  ok, text = doctor.hostname_verdict(1, "n1", "127.0.1.1", "", "10.0.0.1:1234")
  assert not ok and "resolves to 127.0.1.1, a loopback address" in text
  assert "HETJAX_GLOO_INTERFACE" in text
  assert doctor.hostname_verdict(1, "n1", "127.0.1.1", "", "127.0.0.1:1234")[0]
  assert doctor.hostname_verdict(1, "n1", "127.0.1.1", "eth0", "10.0.0.1:1234") == (
      True, "host 1: gloo uses network interface eth0")
  assert doctor.hostname_verdict(1, "n1", "10.0.0.2", "", "10.0.0.1:1234")[0]
  ok, text = doctor.hostname_verdict(2, "n2", "", "", "10.0.0.1:1234")
  assert not ok and "does not resolve" in text


def test_devices_per_host_are_checked_against_the_expectation():
  verdicts = doctor.device_verdicts([8, 8, 4], doctor.parse_expected_devices("8", 3),
                                    ["gpu", "gpu", "gpu"])
  assert [ok for ok, _ in verdicts] == [True, True, False]
  assert "host 2: 4 gpu device(s), expected 8" in verdicts[2][1]
  assert [ok for ok, _ in doctor.device_verdicts([8, 8, 4], [8, 8, 4], ["gpu"] * 3)] == [True] * 3
  (_, (ok, text)) = doctor.device_verdicts([8, 8], None, ["gpu", "cpu"])
  assert not ok and "platform cpu, host 0 has gpu" in text
  with pytest.raises(ValueError, match="gives 2 count"):
    doctor.parse_expected_devices("8,8", 3)


def _doctor_cli(*args, **env):
  base = {k: v for k, v in os.environ.items() if not k.startswith(("HETJAX_", "SLURM_"))}
  base.update(env)
  return subprocess.run([*module_command("hetjax.cli"), "doctor", *args], env=base,
                        capture_output=True, text=True, timeout=120)


def test_a_taken_coordinator_port_is_reported_before_joining():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    run = _doctor_cli(HETJAX_COORDINATOR=f"127.0.0.1:{port}", HETJAX_NUM_HOSTS="2",
                      HETJAX_HOST_ID="0", HETJAX_INIT_TIMEOUT="5")
  assert run.returncode == 2, run.stderr
  assert f"the coordinator port {port} (127.0.0.1:{port}) is taken on this host" in run.stderr
  assert "joining coordinator" not in run.stderr


@pytest.mark.parametrize("args, message", [
    (["--gloo-interface", "nosuch0"], "HETJAX_GLOO_INTERFACE='nosuch0' is no network interface"),
    (["--expect-devices", "2,2"], "--expect-devices '2,2' gives 2 count(s)"),
])
def test_bad_preflight_settings_fail_before_joining(args, message):
  run = _doctor_cli(*args, HETJAX_COORDINATOR="127.0.0.1:9", HETJAX_NUM_HOSTS="3",
                    HETJAX_HOST_ID="1", HETJAX_INIT_TIMEOUT="5")
  assert run.returncode == 2
  assert message in run.stderr and "Could not reach" not in run.stderr
