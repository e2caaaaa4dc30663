"""The sync trainer's checkpoints: what one records beside the state, and a resume.

The state is the replica's global view with the optimizer state whole, not
split, so a run resumes on any number of hosts and devices (invariant 5).
Beside it: the job, the host layout, the data cursor, each host's device
batch and the balancer's state, which a resume on the same layout and
device batches takes back (on another, a profiling balancer warms up afresh).
Functions of a `hetjax.Trainer`, kept apart from its public face.
"""

from __future__ import annotations

from typing import Any

from hetjax.training import lifecycle
from hetjax.training import pipeline as pipeline_lib


def meta(trainer: Any) -> dict[str, Any]:
  """The metadata a checkpoint of `trainer` after `trainer.step` steps records."""
  t = trainer
  meta = {"job": t.job, "layout": lifecycle.layout(t.meshes, t.config.microbatch),
          "data": t.sampler.state_dict(t.step), "device_batches": list(t.device_batches)}
  if hasattr(t.balancer, "state_dict"):
    meta["balancer"] = t.balancer.state_dict()
  return meta


def save(trainer: Any, wait: bool) -> None:
  """`Trainer.save_checkpoint`: the hosts' fingerprints compared first, then saved."""
  t = trainer
  if t.checkpointer is None:
    raise ValueError("this trainer has no checkpoint folder; pass checkpoint=CheckpointConfig(...).")
  if t.checkpointer.last_saved != t.step:
    t.check_params_agree()
  if wait or not t.checkpointer.config.async_save:
    t.checkpointer.save(t.step, t.replica.global_view(), meta(t))
    if wait:
      t.checkpointer.wait()
  else:  # A device copy; a worker thread hands it to orbax while training goes on.
    t.checkpointer.save_in_background(t.step, t.replica.settled(), meta(t), t.meshes.world)


def resume(trainer: Any, custom_balancer: bool) -> None:
  """Continues `trainer` from the newest complete checkpoint, if its folder has one."""
  t = trainer
  restored = t.checkpointer.restore_latest(t.replica.global_view(), t.job)
  if restored is None:
    return
  state, meta = restored
  t.replica.replace(state)
  step = t.sampler.restore(meta["data"])
  t.pipeline.start_step = t.resumed_from = step
  try:
    # Other device batches price other programs (a resume may choose anew).
    if meta["layout"] != lifecycle.layout(t.meshes, t.config.microbatch) or (
        "balancer" not in meta) or meta.get(
        "device_batches", [1] * meta["layout"]["hosts"]) != list(t.device_batches):
      raise ValueError("another host layout")
    t.balancer.load_state_dict(meta["balancer"])
  except (ValueError, AttributeError):
    # Another layout or policy: the old timings say nothing about these
    # hosts, so a profiling balancer warms up afresh from this step.
    if not custom_balancer:
      t.balancer = pipeline_lib.default_balancer(t.config, t.meshes, t.device_batches,
                                                 start_step=step)
  if t.host_id == 0:
    print(f"hetjax: resumed from {t.checkpointer.directory}/{step} (written by "
          f"{meta['layout']['hosts']} host(s) x {meta['layout']['devices_per_host']} device(s))",
          flush=True)
