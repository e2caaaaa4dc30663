"""Under the host reduction nothing that crosses hosts runs on the accelerators.

A job picks `reduction="host"` when its hosts' accelerators cannot share a
collective: two processes on one GPU (NCCL refuses two ranks on one
device), GPUs of two vendors. Then the agreement checks, fingerprints,
votes, timings and evaluation sums must travel over the CPUs too, not only
the step's reduction. A 2-host x 2-device run records every program it
compiles (`_programs_entries.compiled_programs`, from XLA's dump) and each
is placed by its devices: one host's (the local programs, whose collectives stay on the
host), each host's first CPU device (the host reduction's mesh), or else
the device mesh. On this CPU both meshes are CPU devices, so the hosts'
mesh is told by its devices: exactly one per host, each host's first.

A program over the device mesh may exist (the state's initialisation,
replicated by computing it on every device) but must hold no collective
at all: stricter than asking whether a collective's replica groups span
hosts, whose printed form changes between XLA versions (explicit lists,
iota, mesh axes), and a program spanning hosts has no host-local
collective to hold (those run in the local programs).
"""

import jax
import numpy as np
import pytest

from hetjax.testing import run_hosts

import _programs_entries


def test_a_host_reduction_run_compiles_no_collective_on_the_device_mesh(tmp_path):
  results = run_hosts("_programs_entries:host_backend_run", hosts=2, devices_per_host=2,
                      args=(str(tmp_path / "ckpt"),), timeout_s=300, env=_programs_entries.NO_CACHE,
                      host_env=_programs_entries.recording_hosts(str(tmp_path), 2))
  for host, result in enumerate(results):
    assert result["saved"] == [2, 4], result["saved"]
    on_device_mesh = [p for p in result["run"] if p["where"] == "device mesh" and p["collectives"]]
    assert not on_device_mesh, (
        f"host {host}: collectives across hosts on the device mesh: " + "; ".join(
            f"{p['name']}: {p['collectives'][0]}" for p in on_device_mesh))
    # The recorder sees what it must: the host reduction's collectives on the
    # CPUs, the local programs' on one host, and (the control) a gather of
    # host values over the device mesh.
    where = {p["where"] for p in result["run"] if p["collectives"]}
    assert where == {"hosts mesh", "one host"}, where
    control = [p for p in result["control"] if p["where"] == "device mesh"]
    assert len(control) == 1 and control[0]["collectives"], result["control"]


@pytest.mark.parametrize("mode", ["hybrid", "elastic"])
def test_the_rounds_modes_under_the_host_reduction_compile_no_collective_on_the_device_mesh(
    mode, tmp_path):
  """Their outer update runs on the hosts' CPUs too, split over them and gathered, and
  reaches the device backend's centre (hybrid's outer Nesterov keeps its scalars whole)."""
  results = run_hosts("_programs_entries:rounds_host_backend_run", hosts=2, devices_per_host=2,
                      args=(mode,), timeout_s=300, env=_programs_entries.NO_CACHE,
                      host_env=_programs_entries.recording_hosts(str(tmp_path), 2))
  for host, result in enumerate(results):
    programs = result["programs"]
    on_device_mesh = [p for p in programs if p["where"] == "device mesh" and p["collectives"]]
    assert not on_device_mesh, (
        f"host {host}: collectives across hosts on the device mesh: " + "; ".join(
            f"{p['name']}: {p['collectives'][0]}" for p in on_device_mesh))
    on_cpus = {p["name"] for p in programs if p["where"] == "hosts mesh" and p["collectives"]}
    assert "jit_finish" in on_cpus, sorted(on_cpus)  # The outer update, gathered over the CPUs.
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(result["device"]),
                                 jax.tree.leaves(result["host"])):
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7,
                                 err_msg=f"host {host} {jax.tree_util.keystr(path)}")
