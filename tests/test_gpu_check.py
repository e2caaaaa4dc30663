"""bench/gpu_check.py --smoke: the GPU check runs on this CPU, so it cannot rot between GPU visits.

One smoke run (tiny sizes, every section) is shared by the assertions; the
figures it measures on a CPU mean nothing, so only their form is checked:
every section present with its keys, ratios finite and positive, the
two-host pairs' replicas bit-identical and equal to one process's
parameters. Then what a short GPU hour needs: the plan fits six minutes,
the budget keeps the most valuable sections, and a run killed halfway
leaves the sections it finished.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")
SECTIONS = ("overhead", "precision", "two_hosts", "checkpoint", "device_batches", "exactness")
# hetjax's dependencies that JAX, Flax, optax and orbax do not bring: the
# device machine's own Python may lack them (pyproject.toml).
NOT_ON_THE_DEVICE = {"sklearn", "tensorflow_datasets", "tensorflow", "importlib_resources", "PIL",
                     "matplotlib", "tensorboardX", "tensorboard", "array_record", "grain", "wandb"}


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
  assert list(result["sections"]) == list(SECTIONS)  # Run most valuable first.
  assert set(SECTIONS) == set(result["plan_s"])
  assert result["versions"]["jax"] and result["versions"]["device"]["platform"] == "cpu"
  assert stdout.index("plan (smoke)") < stdout.index("== overhead")  # The plan comes first.
  for name in SECTIONS:
    section = result["sections"][name]
    assert section["status"] == "ok", section
    assert section["seconds"] >= 0
    assert f"-- {name}: " in stdout  # The closing table names every section.


def test_the_run_imports_nothing_the_device_machine_lacks(smoke):
  packages = set(smoke[1]["packages"])
  assert {"hetjax", "jax", "flax", "optax", "orbax", "numpy"} <= packages
  assert not packages & NOT_ON_THE_DEVICE, packages & NOT_ON_THE_DEVICE


def test_overhead_rows_in_both_precisions(smoke):
  rows = smoke[1]["sections"]["overhead"]["rows"]
  assert set(rows) == {"mlp/fp32", "mlp/bf16"}
  for row in rows.values():
    assert _positive(row["ratio"]) and _positive(row["plain_ms"]) and _positive(row["hetjax_ms"])
    assert math.isfinite(row["added_ms"]) and isinstance(row["meets_target"], bool)


def test_two_hosts_run_the_sharded_update_on_both_backends(smoke):
  s = smoke[1]["sections"]["two_hosts"]
  assert s["shares"][0] != s["shares"][1] and s["memory"]["preallocate"] is False
  assert set(s["backends"]) == {"host", "device"}
  for reduction, r in s["backends"].items():
    assert r["status"] == "ok" and r["replicas_equal"] and r["split_over"] == 2, (reduction, r)
    assert set(r["step_ms"]) == {"host0", "host1"} and all(map(_positive, r["step_ms"].values()))
  assert s["backends"]["host"]["updated_on"].startswith("host CPUs")
  # Under the host reduction the rounds modes run on the pair too, their centres bit-equal.
  modes = s["backends"]["host"]["modes"]
  assert set(modes) == {"hybrid", "elastic"} and "modes" not in s["backends"]["device"]
  for mode, m in modes.items():
    assert m["centres_equal"] and set(m["round_ms"]) == {"host0", "host1"}, (mode, m)
    assert all(map(_positive, m["round_ms"].values())), (mode, m)


def test_one_process_and_the_pairs_reach_the_same_parameters(smoke):
  s = smoke[1]["sections"]["exactness"]
  assert s["pairs_from"] == "two_hosts" and set(s["against"]) == {"host", "device"}
  for r in s["against"].values():
    assert r["params_equal"] and r["max_rel_diff"] < s["rtol"], r


def test_checkpoint_async_and_sync(smoke):
  s = smoke[1]["sections"]["checkpoint"]
  assert s["model"] == "transformer"  # The smoke's token model: make_source's other path.
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
  assert set(speedup) == {"mlp"}
  assert all(_positive(v) for r in speedup.values() for v in r.values())


def test_a_run_killed_halfway_keeps_the_sections_it_finished(smoke, tmp_path):
  """Killed (SIGKILL, nothing to clean up) while its second section runs: the JSON holds
  the first section's figures, the second one as running, and the earlier run's others.

  The first section is precision (figures from the earlier run's overhead rows, no
  compiles): the test pays for a start-up, not for a section's work.
  """
  out, before, _ = smoke
  shutil.copy(out / "gpu_check.json", tmp_path / "gpu_check.json")
  run = subprocess.Popen([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path),
                          "--sections", "precision,checkpoint"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
  try:
    for line in run.stdout:
      if line.startswith("== checkpoint"):
        run.kill()
        break
  finally:
    run.kill()
    run.wait(timeout=60)
  assert run.returncode == -signal.SIGKILL
  with open(tmp_path / "gpu_check.json") as f:
    after = json.load(f)
  precision = after["sections"]["precision"]
  assert precision["status"] == "ok" and precision["speedup"]
  assert precision["started"] > before["sections"]["precision"]["started"]  # This run's.
  assert after["sections"]["checkpoint"]["status"] == "running"
  assert after["sections"]["overhead"] == before["sections"]["overhead"]


def _plan(*args: str) -> tuple[dict[str, str], int]:
  """`--plan`'s lines by section, and its total seconds (no JAX is imported)."""
  run = _run("--plan", *args)
  assert run.returncode == 0, run.stderr
  lines = {m.group(1): m.group(2) for m in re.finditer(r"^ +(\S+) +(\d+ s.*)$", run.stdout, re.M)}
  return lines, int(lines["total"].split()[0])


def test_the_gpu_plan_fits_six_minutes_and_the_budget_keeps_the_most_valuable():
  lines, total = _plan()
  assert set(SECTIONS) <= set(lines) and total <= 360, lines
  assert not any("left out" in line for line in lines.values())  # The default budget runs all.
  # Overhead rows are cut one by one; a cheap section still runs after one that no longer fits.
  lines, _ = _plan("--budget", "150")
  assert "rows: the rest over the budget" in lines["overhead"], lines
  lines, _ = _plan("--budget", "90", "--sections", "exactness,checkpoint,two_hosts")
  assert "left out" in lines["checkpoint"], lines
  assert "left out" not in lines["two_hosts"] and "left out" not in lines["exactness"], lines


def test_bad_flags_answer_before_anything_runs():
  bad = _run("--smoke", "--out", "x", "--sections", "overhead,nope")
  assert bad.returncode == 2 and "--sections ['nope']" in bad.stderr
  bad = _run("--plan", "--budget", "-5")
  assert bad.returncode == 2 and "--budget -5" in bad.stderr


def test_a_refused_pair_is_one_line_in_the_table():
  """The H200's refusal of the device pair, as gpu_check.json recorded it (cut): the
  table, often all a GPU visit brings back, shows NCCL's reason, not two tracebacks."""
  path = list(sys.path)
  sys.path.insert(0, os.path.dirname(SCRIPT))
  try:
    import gpu_check  # pylint: disable=import-outside-toplevel
  finally:
    sys.path[:] = path  # It puts bench/ first: `checkpoint`, `input` would shadow others.
  error = ("RuntimeError: host 1 of 2 failed in gpu_check:two_hosts_entry (exit code 1):\n"
           "Traceback (most recent call last):\n"
           '  File "/work/main/hetjax/mesh.py", line 186, in gather_host_values\n'
           "    rows = np.asarray(_all_gather(mesh)(_rows_on(values, mesh)))\n"
           "jax.errors.JaxRuntimeError: INTERNAL: NCCL operation ncclCommInitRankConfig(...) "
           "failed: invalid usage. Last NCCL warning(error) log entry (may be unrelated) "
           "'Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60'.\n"
           "\nhost 0 also failed: jax.errors.JaxRuntimeError: INTERNAL: NCCL operation failed: "
           "'Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60'.\n")
  line = gpu_check.headline(error)
  assert "\n" not in line and line.startswith("host 0 also failed: ")
  assert "Duplicate GPU detected" in line
  assert gpu_check.headline("Traceback (most recent call last):\n  ...\nValueError: bad k\n") == (
      "ValueError: bad k")
  assert len(gpu_check.headline("x" * 1000)) == 300
