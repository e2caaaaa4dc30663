"""Test-wide settings: JAX's persistent compilation cache and XLA's cheap backend passes.

Every emulated host is a fresh process that compiles the same programs; JAX's
own persistent cache (its public JAX_COMPILATION_CACHE_DIR, new for each
pytest run) lets later runs of a program load it. JAX writes that cache from
process 0 only and keys a program by its devices, so hosts 1, 2, ... compile
their own: that is the price of testing what users run. The programs run a
few steps on tiny inputs, so the suite asks XLA:CPU for its cheap backend
passes (as tests/test_models.py does for its own programs): the same HLO,
the same math, LLVM at -O0 and one codegen thread (2 cores hold 3 hosts).
The children inherit the setting through the environment. Set
HETJAX_TEST_FULL_OPT=1 to run the suite with XLA's default passes.
"""

import os
import tempfile

_cache = tempfile.mkdtemp(prefix="hetjax-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

_CHEAP_PASSES = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("HETJAX_TEST_FULL_OPT") != "1":
  _flags = os.environ.get("XLA_FLAGS", "").split()
  _named = {flag.split("=")[0] for flag in _flags}
  os.environ["XLA_FLAGS"] = " ".join(
      _flags + [flag for flag in _CHEAP_PASSES if flag.split("=")[0] not in _named])

# Property tests draw the same examples in every run (derandomize): a CI
# failure replays on any machine, and a pass is not luck of the draw. No
# example database (CI starts from a fresh clone) and no deadline (a shared
# machine's load would turn a slow example into a failure).
# HYPOTHESIS_PROFILE=explore draws fresh random examples, for a local hunt.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, database=None, deadline=None)
_hypothesis_settings.register_profile("explore", derandomize=False, deadline=None)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ---- warm test hosts ---------------------------------------------------------------
# Every emulated host of `run_hosts`, and the CLI tests' hosts started through
# `_warm_client.module_command`, is forked from one interpreter that imported
# JAX, Flax, optax and orbax once (tests/_warm_hosts.py): a fresh host spends
# ~3.4 s of CPU on those imports, and the suite starts about a hundred hosts
# on 2 cores. JAX itself is not patched: hosts share programs only through
# its own persistent cache (above). HETJAX_TEST_COLD_HOSTS=1 starts every
# host as a fresh interpreter instead.
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def warm_hosts(request):
  # The quick tier starts no host: no server to import JAX for it.
  if os.environ.get("HETJAX_TEST_COLD_HOSTS") == "1" or request.config.option.markexpr == "quick":
    yield None
    return
  import _warm_hosts
  with _warm_hosts.running() as path:
    yield path


# ---- the exactness matrix's runs, shared by four test files --------------------
# tests/test_exactness.py, tests/test_sharded_update.py, tests/test_device_batch.py
# and tests/test_within_host.py check the same 3x2 runs (with device batches 4, 2, 1,
# on an uneven then a balanced split, host 2 sharding within itself) and the same
# 1x1 runs (the sharded update against the fused one; k = 1): one run of each serves
# all four (cluster starts and compiles are most of their cost). Imported inside the
# fixtures: collecting a test that needs no JAX should not load it.


@pytest.fixture(scope="session")
def exact_runs(tmp_path_factory):
  """(1x1 results, per-host 3x2 results, the folder of the 3x2 runs' checkpoints).

  The 3x2 cluster runs in a thread while this process runs the 1x1 matrix,
  then test_exactness's oracle: alone, the 1x1 run leaves cores idle (XLA
  compiles a program on one core) and so does the cluster (its hosts start
  up, then wait on each other in collectives: host 2 holds 6 of 62
  samples). The results do not depend on timing (the balancer sees
  recorded timings).
  """
  import concurrent.futures
  import jax
  import _exact_entries as ex
  from hetjax.testing import run_hosts
  from test_exactness import cached_oracle
  folder = str(tmp_path_factory.mktemp("exact-ckpt"))
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    cluster = pool.submit(run_hosts, "_exact_entries:clusters", hosts=3, devices_per_host=2,
                          args=(folder,), timeout_s=900)
    one = ex.matrix("equal", plan=ex.ONE_DEVICE_REDUCTION)
    assert (jax.process_count(), jax.local_device_count()) == (1, 1)
    for model in ex.MODELS:  # Cached for the tests that compare with it.
      cached_oracle(model)
    hosts = cluster.result()
  return one, hosts, folder


@pytest.fixture(scope="session")
def exact_one_device(exact_runs):
  """1 host x 1 device: each model with the backend its 3x2 run does not use, in this process."""
  return exact_runs[0]


@pytest.fixture(scope="session")
def exact_clusters(exact_runs):
  """3 hosts x 2 devices, one start: (per-host results, the folder of their checkpoints)."""
  return exact_runs[1:]


# ---- two workers (pytest-xdist) -----------------------------------------------------
# pyproject.toml's addopts ask for `-n auto`: two workers, fed whole files,
# the longest first (tests/_scheduling.py). `-n 0` runs in this process.
import _scheduling  # noqa: E402


def pytest_xdist_auto_num_workers(config):
  return min(_scheduling.WORKERS, os.cpu_count() or 1)


def pytest_xdist_make_scheduler(config, log):
  return _scheduling.make_scheduler(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
  _scheduling.mark_quick(items)  # Before pytest's -m filter deselects the unmarked.
  _scheduling.longest_first(items)


def pytest_configure(config):
  path = os.environ.get("HETJAX_TEST_DURATIONS")
  if path and not os.environ.get("PYTEST_XDIST_WORKER"):
    config.pluginmanager.register(_scheduling.DurationRecorder(path), "hetjax-durations")
