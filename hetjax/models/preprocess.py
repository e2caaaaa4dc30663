"""How models take their input: uint8 pixels become floats on the device, not on the host.

uint8 moves a quarter of float32's bytes to the accelerator; scaling to [0, 1]
costs the device one fused multiply. Float inputs pass through untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from hetjax import task as task_lib


def scale_pixels(batch: dict, key: str = "x") -> dict:
  """`batch[key]` as float32 in [0, 1] when it holds uint8 pixels, else unchanged."""
  x = batch.get(key)
  if x is None or x.dtype != jnp.uint8:
    return batch
  return {**batch, key: x.astype(jnp.float32) * jnp.float32(1 / 255)}


def as_input(x: jax.Array, dtype: Any) -> jax.Array:
  """`x` in the module's compute `dtype`; None leaves it for the first layer to promote with
  the parameters (whatever `--precision` cast them to)."""
  return x if dtype is None else x.astype(dtype)


def on_device_scaling(task: task_lib.Task, key: str = "x") -> task_lib.Task:
  """`task` with uint8 `batch[key]` scaled to [0, 1] inside its jitted functions."""

  def init(rng, batch):
    return task.init(rng, scale_pixels(batch, key))

  def wrap(loss):
    if loss is None:
      return None
    return lambda params, state, batch, rng: loss(params, state, scale_pixels(batch, key), rng)

  return dataclasses.replace(task, init=init, loss=wrap(task.loss), eval_loss=wrap(task.eval_loss),
                             unmasked_loss=wrap(task.unmasked_loss))
