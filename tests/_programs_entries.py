"""Entries that record every program a host compiles (`tests/test_host_values.py`).

`compiled_programs()` reads XLA's own dump (the public XLA_FLAGS option
`--xla_dump_to`, one folder per host: `recording_hosts`): for each program
XLA compiled, its optimized HLO and its device assignment. That is where
GSPMD's own collectives (the all-gather of a re-sharded output) appear,
which the traced program lacks. `where_it_runs` tells a program over one
host's devices from one over several hosts' accelerators (the device mesh)
and one over each host's first CPU device (the host reduction's mesh).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Iterator

import numpy as np

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                        r"collective-permute|collective-broadcast)(-start)?\(")
_DUMP = re.compile(r"--xla_dump_to=(\S+)")
_DEVICE = re.compile(r"replica_device_ids: (\d+)")
# Without JAX's persistent cache: a program loaded from it is not compiled, so not dumped.
NO_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def recording_hosts(folder: str, hosts: int) -> dict[int, dict[str, str]]:
  """`run_hosts`' host_env that makes XLA dump each host's programs into `folder/hostN`."""
  flags = os.environ.get("XLA_FLAGS", "")
  return {h: {"XLA_FLAGS": f"{flags} --xla_dump_to={folder}/host{h}"} for h in range(hosts)}


@contextlib.contextmanager
def compiled_programs() -> Iterator[list[tuple[list[Any], str, str]]]:
  """Appends (devices, name, optimized HLO text) of every program XLA compiled inside.

  Filled when the block ends, from the modules XLA dumped meanwhile.
  """
  import jax
  found = _DUMP.search(os.environ.get("XLA_FLAGS", ""))
  assert found, "run the entry under recording_hosts(): XLA_FLAGS names no --xla_dump_to"
  folder, seen = found.group(1), []
  before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
  yield seen
  by_id = {d.id: d for d in jax.devices()}
  for module in sorted(set(os.listdir(folder)) - before):
    path = os.path.join(folder, module)
    if not os.path.isdir(path):
      continue  # Each compile leaves a folder (its options) beside its text files.
    with open(os.path.join(path, "compile_options.textproto")) as f:
      assignment = f.read().split("device_assignment {", 1)[1]
    with open(f"{path}.cpu_after_optimizations.txt") as f:
      hlo = f.read()
    devices = [by_id[int(i)] for i in _DEVICE.findall(assignment.split("\n  }", 1)[0])]
    seen.append((devices, hlo.split(None, 2)[1].rstrip(","), hlo))


def where_it_runs(devices: list[Any], hosts_mesh: set[Any]) -> str:
  """'one host', 'hosts mesh' (exactly the host reduction's CPUs) or 'device mesh'."""
  if len({d.process_index for d in devices}) == 1:
    return "one host"
  return "hosts mesh" if set(devices) == hosts_mesh else "device mesh"


def describe(seen: list[tuple[list[Any], str, str]], hosts_mesh: set[Any]) -> list[dict]:
  """Each recorded program as plain data: its name, where it runs, its collectives' lines."""
  return [{"name": name, "where": where_it_runs(devices, hosts_mesh),
           "devices": len(devices),
           "collectives": [line.strip()[:300] for line in hlo.splitlines()
                           if COLLECTIVE.search(line)]}
          for devices, name, hlo in seen]


def host_backend_run(folder: str) -> dict[str, list[dict]]:
  """A small `reduction="host"` run touching every path that crosses hosts; its programs.

  The configuration agreement, the replicas' fingerprints (every 2 steps and
  before each save), the sharded update on the CPUs, evaluation sums, the
  checkpointer's votes after each save, the last timings gathered by the
  summary. (A resume votes through the same gather, and orbax's restore
  compiles programs of one device each: left out, to keep the suite short.)
  Then, as a control, one gather of host values over the device mesh,
  which the recorder must see as such.
  """
  import optax
  import hetjax
  from hetjax import mesh as mesh_lib
  from hetjax import models as zoo
  from hetjax.input import sources

  hetjax.initialize()
  source = sources.synthetic_images(size=64)
  task = zoo.build("mlp", kind="image", num_classes=10, hidden=(8,))
  config = hetjax.TrainConfig(global_batch=16, microbatch=4, reduction="host", check_every=2,
                              assignment=(4, 12))
  checkpoint = hetjax.CheckpointConfig(folder, every=2)
  hosts_mesh = set(mesh_lib.Meshes.create("host").hosts.devices.flat)
  with compiled_programs() as seen:
    trainer = hetjax.Trainer(task, optax.adam(1e-3), source, config, checkpoint=checkpoint)
    trainer.fit(4, eval_every=2, eval_source=sources.synthetic_images(size=24, seed=1))
    trainer.close()
  with compiled_programs() as control:
    # Seven values: a shape no gather of the run had, so it compiles here.
    mesh_lib.gather_host_values(np.ones(7), mesh_lib.Meshes.create("device"))
  return {"run": describe(seen, hosts_mesh), "control": describe(control, hosts_mesh),
          "saved": sorted(int(p) for p in os.listdir(folder) if p.isdigit())}


def rounds_host_backend_run(mode_name: str) -> dict:
  """A short run of a rounds mode ('hybrid' or 'elastic') on each backend.

  Two rounds of two local steps and an evaluation: the local steps, the
  round's reduction, the outer update, the agreement and the summary's
  gather. The `reduction="host"` run's programs, and both runs' centres.
  """
  import optax
  import hetjax
  from hetjax import mesh as mesh_lib
  from hetjax import models as zoo
  from hetjax.input import sources

  hetjax.initialize()
  source = sources.synthetic_images(size=64)
  hosts_mesh = set(mesh_lib.Meshes.create("host").hosts.devices.flat)
  out = {}
  for reduction in ("host", "device"):
    task = zoo.build("mlp", kind="image", num_classes=10, hidden=(8,))
    config = hetjax.TrainConfig(global_batch=16, microbatch=4, reduction=reduction,
                                check_every=2)
    mode = {"hybrid": hetjax.Hybrid(local_steps=(2, 2), local_batch=8),  # Nesterov outside.
            "elastic": hetjax.Elastic(local_steps=(2, 2), local_batch=8)}[mode_name]
    with compiled_programs() as seen:
      trainer = hetjax.Trainer(task, optax.sgd(0.1), source, config, mode=mode)
      trainer.fit(2, eval_every=2, eval_source=sources.synthetic_images(size=24, seed=1))
      out[reduction] = trainer.params()
      trainer.close()
    if reduction == "host":
      out["programs"] = describe(seen, hosts_mesh)
  return out
