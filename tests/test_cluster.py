"""Multi-host behaviour on emulated CPU clusters (one process per host, gloo)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from hetjax.testing import run_hosts

from _warm_client import module_command

import _cluster_entries

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def three_hosts():
  """One 3-host cluster for the next three tests: starting it is the expensive part."""
  return run_hosts("_cluster_entries:share_zero_moving_shares_and_mismatch", hosts=3,
                   timeout_s=600)


def test_a_host_with_share_zero_joins_and_changes_nothing(three_hosts):
  # One host, in this process; SGD, so a normaliser off by the host count shows.
  ref, _ = _cluster_entries.train_params("mlp", "equal", "device", optimizer_="sgd")
  results = [r["share_zero"] for r in three_hosts]
  for params, summary in results:
    _close(params, ref)
    assert summary["per_host"][0]["batch"] == [0] * 10
  # Host 0 applies every update alone (no micro-batch), hosts 1 and 2 in
  # their next step's first program: the same bits.
  for params, _ in results[1:]:
    jax.tree.map(np.testing.assert_array_equal, params, results[0][0])


def test_moving_shares_never_recompiles(three_hosts):
  results = [r["moving"] for r in three_hosts]
  for r in results:
    assert r["after_warmup"] == 0
    assert r["in_warmup"] > 0, "the listener heard no compile, even in the warm-up"
    splits = _cluster_entries.MOVING_SPLITS
    assert r["shares"][2:] == splits[2:] + splits  # Shares moved every step,
    assert r["device_batches"] == list(_cluster_entries.MOVING_DEVICE_BATCHES)  # on device batches.
  _close(results[0]["params"], results[2]["params"])
  for r in results[1:]:  # Hosts took the update-alone path at different steps.
    jax.tree.map(np.testing.assert_array_equal, r["params"], results[0]["params"])


def test_hosts_with_different_configurations_refuse_to_train(three_hosts):
  messages = [r["mismatch"] for r in three_hosts]  # Host 1 has another seed than hosts 0 and 2.
  assert all(m is not None and "host(s) [1]" in m and "same command" in m for m in messages)


def test_readme_example_gives_the_same_parameters_on_one_and_three_uneven_hosts(tmp_path):
  example = ROOT / "examples" / "custom_model.py"
  assert example.read_text() in (ROOT / "README.md").read_text(), "README must show the example"
  one, three = tmp_path / "one.npz", tmp_path / "three.npz"
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  # The one-host run goes beside the three-host one: independent processes, one wall time.
  log = tmp_path / "one.log"
  with open(log, "w") as f:
    single = subprocess.Popen([sys.executable, str(example), "--out", str(one)], env=env,
                              stdout=f, stderr=subprocess.STDOUT)
  try:
    run = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3", "--speeds",
         "1,0.5,0.25", "--", sys.executable, str(example), "--assignment", "8,24,32", "--out",
         str(three)], env=env, timeout=300, capture_output=True, text=True)
    assert single.wait(timeout=300) == 0, log.read_text()[-3000:]
  finally:
    if single.poll() is None:
      single.kill()
      single.wait()
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "shares [8, 24, 32]" in run.stdout
  a, b = np.load(one), np.load(three)
  assert list(a) == list(b)
  for k in a:
    np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_the_demo_command_writes_the_summary_contract(tmp_path):
  out = tmp_path / "run"
  # The README demo's flags, shortened: emulated devices, a slowdown, the dynamic balancer.
  cmd = [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "3", "--devices-per-host", "1",
         "--speeds", "1,0.5,0.25", "--device-sample-ms", "0.5", "--slowdown", "0:3@8", "--",
         *module_command("hetjax.cli"), "train", "--model", "mlp", "--dataset", "digits",
         "--global-batch", "48", "--steps", "10", "--balancer", "dynamic", "--microbatch", "4",
         "--out", str(out), "--config", str(tmp_path / "run.yaml")]
  (tmp_path / "run.yaml").write_text(f"save-params: {tmp_path / 'p.npz'}\n")  # A config key.
  run = subprocess.run(cmd, timeout=300, capture_output=True, text=True)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  for key in ("steps", "global_batch", "hosts", "samples_per_sec", "final_loss", "params_digest"):
    assert key in summary
  assert (summary["steps"], summary["global_batch"], summary["hosts"]) == (10, 48, 3)
  shares = list(zip(*(h["batch"] for h in summary["per_host"])))
  assert shares[0] == (16, 16, 16) and all(sum(s) == 48 for s in shares)
  assert all(len(h["compute_s"]) == len(h["wait_s"]) == 10 for h in summary["per_host"])
  assert summary["emulated_speeds"] is True and summary["balancer_mode"] == "dynamic"
  assert summary["balancer_decisions"][0]["reason"] == "warm-up: equal split"
  assert len(np.load(tmp_path / "p.npz").files) > 0


# What SLURM puts in every task's environment under srun; JAX's own detection
# would narrow each process to the GPU numbered SLURM_LOCALID.
_SLURM_TASK = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
               "SLURM_PROCID": "0", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "2"}


def test_explicit_settings_keep_every_local_device_even_inside_slurm():
  results = run_hosts("_cluster_entries:visible_devices", hosts=2, devices_per_host=2,
                      env=_SLURM_TASK)
  assert results == [{"host": h, "hosts": 2, "local_devices": 2, "cuda_visible_devices": "all"}
                     for h in range(2)]


def test_a_slurm_job_without_an_srun_step_trains_as_one_host(tmp_path):
  """`hetjax train` inside salloc, or in a batch script without srun."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HETJAX_"))}
  env.update(SLURM_JOB_ID="1", SLURM_LOCALID="0")
  run = subprocess.run([*module_command("hetjax.cli"), "train", "--model", "mlp", "--steps",
                        "2", "--out", str(tmp_path / "run")], env=env, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "[hetjax] SLURM job 1 with no srun step (salloc, or a batch script): one host" in run.stderr
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert (summary["hosts"], summary["steps"]) == (1, 2)


def test_the_gloo_interface_can_be_named():
  assert run_hosts("_cluster_entries:cross_host_sum", hosts=2,
                   env={"HETJAX_GLOO_INTERFACE": "lo"}) == [3.0, 3.0]


def test_an_unknown_gloo_interface_is_refused_before_joining():
  with pytest.raises(RuntimeError, match=r"HETJAX_GLOO_INTERFACE='nosuch0' is no network interface "
                                         r"of this machine .*; it has .*lo"):
    run_hosts("_cluster_entries:cross_host_sum", hosts=2, env={"HETJAX_GLOO_INTERFACE": "nosuch0"},
              timeout_s=120)


def test_an_ipv6_coordinator_works():
  from hetjax.cluster import procs
  import socket
  with socket.socket(socket.AF_INET6) as sock:
    sock.bind(("::1", 0))  # This machine has an IPv6 loopback; a test machine without one fails here.
    port = sock.getsockname()[1]
  code = ("import hetjax; t = hetjax.initialize(); print('TOPO', t.host_id, t.num_hosts, flush=True)")
  envs = procs.cluster_envs(2, 1, coordinator=f"[::1]:{port}")
  outcome = procs.run_group([[sys.executable, "-c", code]] * 2, envs, timeout_s=240, grace_s=0.5)
  assert outcome.ok, outcome.tails
  assert [[l for l in tail if l.startswith("TOPO")] for tail in outcome.tails] == [
      ["TOPO 0 2"], ["TOPO 1 2"]]


@pytest.mark.parametrize("local_size, visible", [(1, "all"), (2, None)])
def test_open_mpi_ranks_join_at_the_address_jax_reads_and_keep_their_gpus(local_size, visible):
  """Open MPI 4 (a stand-in: its variables and URI): one rank per node keeps every GPU; ranks
  that share a node keep one each (the local rank), as under SLURM."""
  from hetjax.cluster import procs
  port = procs.free_port()
  code = ("import hetjax, jax; t = hetjax.initialize(); print('TOPO', t.host_id, t.num_hosts, "
          "jax.config.values['jax_cuda_visible_devices'], flush=True)")
  base = {k: v for k, v in os.environ.items() if not k.startswith(("HETJAX_", "SLURM_", "OMPI_"))}
  envs = [{**base, "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(h),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(h % local_size),
           "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "JAX_COORDINATOR_PORT": str(port),
           "OMPI_MCA_orte_hnp_uri": "4096.0;tcp://127.0.0.1:1234"} for h in range(2)]
  outcome = procs.run_group([[sys.executable, "-c", code]] * 2, envs, timeout_s=240, grace_s=0.5)
  assert outcome.ok, outcome.tails
  assert [[l for l in tail if l.startswith("TOPO")] for tail in outcome.tails] == [
      [f"TOPO {h} 2 {visible or h}"] for h in range(2)]
