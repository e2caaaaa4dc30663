"""`hetjax doctor` on an emulated 3-host cluster, and its input checks."""

import pytest

from hetjax import doctor
from hetjax.testing import run_hosts

SPEEDS = (1.0, 0.5, 0.25)


def test_doctor_on_three_emulated_hosts(tmp_path):
  path = str(tmp_path / "doctor.json")
  results = run_hosts("_doctor_entries:doctor_on_every_host", hosts=3, devices_per_host=2,
                      speeds=SPEEDS, args=(path,), timeout_s=120)
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

  # The pacing stretches every step by 1 / speed, so the reported figure is
  # the real one times the speed; host 2 (4x slower) is the slowest.
  for h, speed in zip(hosts, SPEEDS):
    assert h["samples_per_sec"] == pytest.approx(h["real_samples_per_sec"] * speed, rel=1e-3)
  assert hosts[0]["samples_per_sec"] > hosts[2]["samples_per_sec"]

  assert "cross-host sum: ok (got 12, expected 12" in text
  assert "emulated speed 0.25" in text and "doctor: all checks passed" in text
  assert text.count("2 x cpu") == 3


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
