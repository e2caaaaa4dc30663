"""Entry point for the dynamic balancing test: a recorded device-time model, no clock noise."""

from __future__ import annotations

import jax

import hetjax
from _cluster_entries import optimizer
from hetjax import models as zoo
from hetjax import trainer
from hetjax.input import data

PER_SAMPLE_S = 1e-3


def dynamic_balancing_on_recorded_timings(steps: int, slow_host: int, factor: float, from_step: int):
  """The dynamic balancer fed modelled compute times: samples x seconds per sample.

  The pace hook reports `samples * PER_SAMPLE_S` (times `factor` on
  `slow_host` from `from_step` on) in place of the measured compute, and
  never sleeps: what the balancer sees is a function of the shares alone, so
  every run makes the same decisions (the measured seconds, milliseconds of
  scheduling noise on a shared machine, never reach it).
  """
  hetjax.initialize()
  host = jax.process_index()

  def recorded(compute_s, step, samples=0):
    del compute_s
    slow = host == slow_host and step >= from_step
    return samples * PER_SAMPLE_S * (factor if slow else 1.0)

  task = zoo.build("mlp", kind="image", num_classes=10)
  config = trainer.TrainConfig(global_batch=256, microbatch=16, balancer="dynamic")
  # SGD: the comparison with one host must see a normaliser off by a factor.
  tr = trainer.Trainer(task, optimizer("sgd"), data.load("digits"), config, pace=recorded)
  summary = tr.fit(steps)
  return {"shares": list(tr.history.shares), "params": tr.params(),
          "decisions": summary["balancer_decisions"]}
