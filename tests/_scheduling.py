"""How the suite spreads over its two workers (pytest-xdist): whole files, the longest first.

Run serially, the suite keeps 2 cores 71 % busy: a multi-host test's hosts
wait on each other and on SLURM, a one-process test compiles on one core.
Two workers fill those gaps. A file is the unit (its module fixtures start
clusters; split over workers they would start twice), and the four files
that read the exactness matrix's runs are one unit (`EXACT_RUNS`: one
session fixture trains them). Units go out longest first, from the seconds
each file took in a serial run (`durations.json`), so that no long file
starts last; a file missing from it counts `UNKNOWN_S`. A stale table only
changes the order, never a result.

Refresh the table after a change that moves a file's time a lot:
  HETJAX_TEST_DURATIONS=tests/durations.json .venv/bin/python -m pytest -q -n 0
"""

from __future__ import annotations

import collections
import functools
import json
import os

import pytest

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
EXACT_RUNS = ("test_exactness.py", "test_sharded_update.py", "test_device_batch.py",
              "test_within_host.py")
EXACT_UNIT = "exactness matrix runs"
UNKNOWN_S = 10.0
WORKERS = 2  # Each worker's multi-host tests start 2-3 hosts: more would overload 2 cores.


def file_of(nodeid: str) -> str:
  return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def unit_of(nodeid: str) -> str:
  """The scheduling unit: the file, or the exactness runs' files together."""
  name = file_of(nodeid)
  return EXACT_UNIT if name in EXACT_RUNS else name


def _recorded_seconds() -> dict[str, float]:
  try:
    with open(TABLE) as f:
      return json.load(f)
  except FileNotFoundError:
    return {}


def longest_first(items: list[pytest.Item]) -> None:
  """Sorts test items in place: units by their recorded seconds, longest first; a unit's
  tests stay together and in their order."""
  seconds = _recorded_seconds()

  @functools.cache
  def cost(unit: str) -> float:
    return sum(seconds.get(name, UNKNOWN_S) for name in (EXACT_RUNS if unit == EXACT_UNIT
                                                         else (unit,)))

  position = {id(item): i for i, item in enumerate(items)}
  items.sort(key=lambda item: (-cost(unit_of(item.nodeid)), unit_of(item.nodeid),
                               position[id(item)]))


def make_scheduler(config: pytest.Config, log):
  """xdist's scope scheduler with `unit_of` as the scope, in the collection's order."""
  from xdist.scheduler import LoadScopeScheduling

  class ByUnit(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return unit_of(nodeid)

  config.option.loadscopereorder = False  # Keep `longest_first`'s order, not test counts.
  return ByUnit(config, log)


# The quick tier (`pytest -m quick`, docs/testing.md): one process each, no host
# started, the core promises: the balancer and simulator, blocks and the sampler,
# the config, emulation, agreement, checkpoints' identity, one trainer, and one
# exactness check against the oracle. A file name, or FILE::TEST_PREFIX.
QUICK = ("test_balancer.py", "test_ladder.py", "test_sim.py", "test_sim_price.py",
         "test_sim_rounds.py", "test_config_file.py", "test_emulate.py", "test_packing.py",
         "test_agreement.py", "test_phases.py", "test_supervise.py", "test_metrics.py",
         "test_output.py", "test_snapshot.py", "test_goodput.py", "test_mode_threshold.py",
         "test_history.py", "test_optimizer_layout.py", "test_mode_protocol.py",
         "test_host_path.py", "test_lost_peer.py", "test_docs.py", "test_data.py",
         "test_core.py::test_micro_batches", "test_core.py::test_host_slices",
         "test_core.py::test_equal_split", "test_core.py::test_bad_assignments",
         "test_core.py::test_batchnorm_running", "test_blocks.py::test_block_shares",
         "test_blocks.py::test_a_split_that_cuts", "test_blocks.py::test_the_equal_policy",
         "test_blocks.py::test_contract_violations",
         "test_full_blocks.py::test_whole_blocks_match_the_oracle[linen]")  # ResNet-10: 4x its time.


def mark_quick(items: list[pytest.Item]) -> None:
  """Adds the `quick` marker to the tests QUICK names."""
  for item in items:
    name = item.nodeid.rsplit("/", 1)[-1]
    if any(name == q or name.startswith(q if "::" in q else q + "::") for q in QUICK):
      item.add_marker(pytest.mark.quick)


class DurationRecorder:
  """Adds up each file's seconds (setup, call, teardown) and writes them as `durations.json`."""

  def __init__(self, path: str):
    self.path = path
    self.seconds: dict[str, float] = collections.defaultdict(float)

  def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
    self.seconds[file_of(report.nodeid)] += report.duration

  def pytest_sessionfinish(self) -> None:
    ordered = sorted(self.seconds.items(), key=lambda kv: -kv[1])
    with open(self.path, "w") as f:
      json.dump({name: round(s, 1) for name, s in ordered}, f, indent=1)
      f.write("\n")
