"""What the sync trainer and the rounds trainer share around their loops.

`hetjax.Trainer` (one reduction per step) and `hetjax.modes.RoundsTrainer`
(one per round) train differently but present a run the same way: the
same `fit()` arguments, the same run folder (metrics.jsonl, TensorBoard,
summary.json), the same summary fields, the same checkpoint layout record
and vote, the same evaluation bookkeeping. Those pieces live here, as
functions of explicit arguments, so neither trainer reaches into the other.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

import jax
import numpy as np

from hetjax.input import data as data_lib
from hetjax.training import evaluate as evaluate_lib
from hetjax.observe import metrics as metrics_lib
from hetjax.cluster import signals
from hetjax import mesh as mesh_lib
from hetjax.task import Task

PyTree = Any
Sink = Callable[[dict[str, Any]], Any]


def check_fit_args(count: int | None, until: int | None, eval_every: int,
                   eval_source: data_lib.ArraySource | None, unit: str = "steps") -> None:
  """`fit()`'s argument checks; `unit` names what the run counts ('steps' or 'rounds')."""
  if (count is None) == (until is None):
    raise ValueError(f"give fit() exactly one of {unit} (how many more) or until (the last "
                     f"{unit[:-1]}).")
  if count is not None and count < 0:
    raise ValueError(f"{unit} must be >= 0, got {count}.")
  if eval_every < 0:
    raise ValueError(f"eval_every must be >= 0 {unit} (0: evaluate only at the end), got "
                     f"{eval_every}.")
  if eval_every and eval_source is None:
    raise ValueError(f"eval_every={eval_every} needs eval_source, the split to evaluate on.")


def open_run_folder(out: str | None, host_id: int, resume_step: int,
                    sinks: Sequence[Sink]) -> tuple[metrics_lib.MetricsWriter | None, list[Sink]]:
  """Process 0's metrics writer for `out` (None elsewhere or without `out`), and the sinks with it."""
  if out is None or host_id != 0:
    return None, list(sinks)
  writer = metrics_lib.MetricsWriter(out, resume_step=resume_step or None)
  return writer, [*sinks, writer.write]


def close_run(checkpointer: Any, save: Callable[[], None], summarize: Callable[[], dict],
              flush: Callable[[], Any], out: str | None, host_id: int) -> dict[str, Any]:
  """The end of `fit()`, finished or stopped: save (waiting), summarise, flush the records, write.

  `flush` hands the sinks the last record, whose wait seconds `summarize`
  gathered.
  """
  if checkpointer is not None:
    save()
  summary = summarize()
  flush()
  if out is not None:
    write_summary(out, summary, host_id)
  return summary


def stop_run(code: float, at: int, checkpointer: Any, save: Callable[[], None],
             summarize: Callable[[], dict], flush: Callable[[], Any], out: str | None,
             host_id: int) -> NoReturn:
  """Every host got the stop flag at the same boundary `at`: close the run as `close_run`, raise."""
  signals.REQUESTS.clear()
  close_run(checkpointer, save, summarize, flush, out, host_id)
  raise signals.stopped(code, at, None if checkpointer is None else checkpointer.directory)


def write_summary(out: str, summary: dict[str, Any], host_id: int) -> None:
  """OUT/summary.json, written by process 0 (what `hetjax report` reads)."""
  if host_id == 0:
    metrics_lib.write_summary(out, summary)


def all_hosts_agree(flag: bool, meshes: mesh_lib.Meshes) -> bool:
  """True when every host says yes (the checkpointer's vote)."""
  flags = mesh_lib.gather_host_values(np.array([float(flag)]), meshes)
  return bool(np.all(flags > 0))


def layout(meshes: mesh_lib.Meshes, microbatch: int) -> dict[str, Any]:
  """The host layout a checkpoint records; a resume compares it with its own."""
  return {"hosts": meshes.num_hosts, "devices_per_host": list(meshes.devices_per_host()),
          "microbatch": microbatch}


def host_copy(params: PyTree) -> PyTree:
  """Replicated arrays as host numpy arrays (this host's copy)."""
  return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)


def evaluator_for(current: evaluate_lib.Evaluator | None, task: Task, meshes: mesh_lib.Meshes,
                  batch_size: int) -> evaluate_lib.Evaluator:
  """`current` if it evaluates `batch_size` per device, else a new one (compiled once per size)."""
  if current is None or current.batch != batch_size * meshes.local_devices:
    current = evaluate_lib.Evaluator(task, meshes, batch_size)
  return current


def last_eval(evals: dict[int, dict[str, float]], first_step: int) -> dict[str, Any] | None:
  """The newest evaluation as `{step, figures...}`; `evals` is keyed by history index."""
  if not evals:
    return None
  index = max(evals)
  return {"step": first_step + index + 1, **evals[index]}  # Steps done, as the records count.


def summary_fields(*, steps: int, last_step: int, resumed_from: int | None, config: Any,
                   meshes: mesh_lib.Meshes, balancer_mode: str, balancer_decisions: list,
                   samples_per_sec: float, losses: Sequence[float],
                   metrics: Sequence[dict[str, float]], params_digest: str | None,
                   evaluation: dict[str, Any] | None, emulated: bool,
                   per_host: list[dict[str, Any]]) -> dict[str, Any]:
  """The summary every trainer returns from `fit()` (a mode adds its own fields)."""
  return {
      "steps": steps,
      "last_step": last_step,
      "resumed_from": resumed_from,
      "global_batch": config.global_batch,
      "hosts": meshes.num_hosts,
      "devices_per_host": meshes.local_devices,
      "reduction": config.reduction,
      "balancer_mode": balancer_mode,
      "balancer_decisions": balancer_decisions,
      "samples_per_sec": samples_per_sec,
      "final_loss": losses[-1] if losses else None,
      "final_metrics": metrics[-1] if metrics else {},
      "params_digest": params_digest,
      "eval": evaluation,
      "emulated_speeds": emulated,
      "per_host": per_host,
  }
