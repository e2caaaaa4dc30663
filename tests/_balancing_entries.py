"""Entry point for the dynamic balancing test: a recorded device-time model, no clock noise."""

from __future__ import annotations

import jax

import hetjax
from _cluster_entries import optimizer
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data

PER_SAMPLE_S = 1e-3


def dynamic_balancing_on_recorded_timings(steps: int, slow_host: int, factor: float, from_step: int,
                                          until_step: int | None = None,
                                          device_batch: tuple[int, ...] | int = 1):
  """The dynamic balancer fed modelled compute times: samples x seconds per sample.

  The pace hook reports `samples * PER_SAMPLE_S` (times `factor` on
  `slow_host` from `from_step` until `until_step`) in place of the measured
  compute, and never sleeps: what the balancer sees is a function of the shares alone, so
  every run makes the same decisions (the measured seconds, milliseconds of
  scheduling noise on a shared machine, never reach it). Compilations are counted after the first two steps: with device batches
  every program of each host's ladder is compiled by then, so no share the
  balancer moves to may compile anything. The warm-up's own count is
  returned too: a listener that hears nothing would pass "none after".
  """
  hetjax.initialize()
  host = jax.process_index()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, duration, **kw: compiles.append(event)
      if event == "/jax/core/compile/backend_compile_duration" else None)

  def recorded(compute_s, step, samples=0):
    del compute_s
    slow = host == slow_host and from_step <= step < (until_step or steps)
    return samples * PER_SAMPLE_S * (factor if slow else 1.0)

  task = zoo.build("mlp", kind="image", num_classes=10)
  # No agreement check: its fingerprint program compiles at its first use
  # (step 100), and what is counted here is the step's programs.
  config = trainer.TrainConfig(global_batch=256, microbatch=16, balancer="dynamic",
                               device_batch=device_batch, check_every=0)
  # SGD: the comparison with one host must see a normaliser off by a factor.
  tr = trainer.Trainer(task, optimizer("sgd"), data.load("digits"), config, pace=recorded)
  tr.fit(2)
  warm = len(compiles)
  summary = tr.fit(steps - 2)
  return {"shares": list(tr.history.shares), "params": tr.params(),
          "decisions": summary["balancer_decisions"], "compiles_after_warmup": len(compiles) - warm,
          "compiles_in_warmup": warm,
          "device_batches": summary["device_batches"]}
