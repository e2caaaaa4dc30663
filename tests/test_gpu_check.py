"""bench/gpu_check.py --smoke: the GPU check runs on this CPU, so it cannot rot between GPU visits.

One smoke run (tiny sizes, every section) is shared by the assertions; the
figures it measures on a CPU mean nothing, so only their form is checked:
every section present with its keys, ratios finite and positive, and the
two-host parameters equal to one process's.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
SECTIONS = ("overhead", "two_hosts", "checkpoint", "device_batches", "precision")


def _run(*args: str) -> subprocess.CompletedProcess:
  # The timeout only stops a hung run; nothing asserts how long it took.
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        timeout=1200, cwd=ROOT)


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_check")
  run = _run("--smoke", "--out", str(out))
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  with open(out / "gpu_check.json") as f:
    return out, json.load(f), run.stdout


def test_every_section_is_there_and_the_run_says_what_it_found(smoke):
  _, result, stdout = smoke
  assert result["profile"] == "smoke"
  assert set(SECTIONS) <= set(result["sections"])
  assert set(SECTIONS) == set(result["plan_s"])
  assert result["versions"]["jax"] and result["versions"]["device"]["platform"] == "cpu"
  for name in SECTIONS:
    section = result["sections"][name]
    assert section["status"] == "ok", section
    assert section["seconds"] >= 0
    assert f"-- {name}: " in stdout  # The closing table names every section.


def test_overhead_rows_in_both_precisions(smoke):
  rows = smoke[1]["sections"]["overhead"]["rows"]
  assert set(rows) == {f"{m}/{p}" for m in ("mlp", "transformer") for p in ("fp32", "bf16")}
  for row in rows.values():
    assert _positive(row["ratio"]) and _positive(row["plain_ms"]) and _positive(row["hetjax_ms"])
    assert math.isfinite(row["added_ms"]) and isinstance(row["meets_target"], bool)


def test_two_hosts_on_one_device_reach_one_process_parameters(smoke):
  s = smoke[1]["sections"]["two_hosts"]
  assert s["params_equal"] and s["replicas_equal"], s
  assert s["reduction"] == "host" and s["shares"][0] != s["shares"][1]
  assert s["max_rel_diff"] < s["rtol"]
  assert set(s["step_ms"]) == {"one_process", "host0", "host1"}
  assert all(_positive(v) for v in s["step_ms"].values())


def test_checkpoint_async_and_sync(smoke):
  s = smoke[1]["sections"]["checkpoint"]
  for mode in ("async", "sync"):
    r = s[mode]
    assert r["saves"] >= 1 and _positive(r["step_s"]) and _positive(r["blocking_s"])
    assert _positive(r["blocking_fraction"]) and math.isfinite(r["stall_fraction"])
  assert s["sync"]["snapshot_s"] == 0.0 and s["async"]["snapshot_s"] > 0  # Only async snapshots.
  assert math.isfinite(s["async_over_sync_stall"])


def test_device_batches_time_each_k_and_say_what_auto_picked(smoke):
  s = smoke[1]["sections"]["device_batches"]
  assert set(s["rows"]) == {"1", "4"} and s["rows"]["1"]["over_k1"] == 1.0
  assert all(_positive(r["samples_s"]) and _positive(r["over_k1"]) for r in s["rows"].values())
  auto = s["auto"]  # XLA:CPU reports no memory: auto starts from its documented default.
  assert auto["memory_k"] is None and auto["bytes_limit"] is None
  candidates = sorted(int(j) for j in auto["ms_per_block"])  # It timed k against k / 2.
  assert len(candidates) == 2 and candidates[1] == 2 * candidates[0]
  assert auto["k"] in candidates and "device batch" in auto["says"]


def test_precision_speedups_from_the_overhead_rows(smoke):
  speedup = smoke[1]["sections"]["precision"]["speedup"]
  assert set(speedup) == {"mlp", "transformer"}
  assert all(_positive(v) for r in speedup.values() for v in r.values())


def test_a_rerun_of_one_section_keeps_the_others(smoke):
  out, before, _ = smoke
  # precision reads the overhead rows and runs nothing of its own: the cheapest rerun.
  run = _run("--smoke", "--out", str(out), "--sections", "precision")
  assert run.returncode == 0, run.stderr[-3000:]
  with open(out / "gpu_check.json") as f:
    after = json.load(f)
  assert after["sections"]["overhead"] == before["sections"]["overhead"]
  assert after["sections"]["device_batches"] == before["sections"]["device_batches"]
  assert after["sections"]["precision"]["started"] >= before["sections"]["precision"]["started"]


def test_plan_and_bad_flags_answer_before_anything_runs():
  plan = _run("--plan")
  assert plan.returncode == 0 and all(name in plan.stdout for name in SECTIONS), plan.stderr
  bad = _run("--smoke", "--out", "x", "--sections", "overhead,nope")
  assert bad.returncode == 2 and "--sections ['nope']" in bad.stderr
