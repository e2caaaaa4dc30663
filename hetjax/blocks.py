"""Blocks: the unit that makes every model split-independent (DESIGN invariant 2).

A block is `m` consecutive positions (the per-device micro-batch); a host's
share is whole blocks, and a block's randomness and BatchNorm group are its
own, so any split computes every block the same way. When `m` does not divide
`B` the last block holds `B mod m` real positions (masked). Pure numpy: the
balancer works in blocks and knows nothing else.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hetjax import balancer as balancer_lib


def num_blocks(global_batch: int, block: int) -> int:
  """How many blocks of `block` positions a global batch of `global_batch` has."""
  return -(-int(global_batch) // int(block))


def every_block_whole(global_batch: int, block: int) -> bool:
  """Whether no block is part padding: every block all real, or (a device with
  none) all padding. Only the last block of a batch `block` does not divide is
  partial; a model may then skip the padding mask (`Task.unmasked_loss`)."""
  return int(global_batch) % int(block) == 0


def to_samples(block_shares: Sequence[int], global_batch: int, block: int) -> tuple[int, ...]:
  """Per-host sample shares for per-host block counts (the last block may be partial)."""
  ends = np.minimum(np.cumsum(np.asarray(block_shares, np.int64)) * block, global_batch)
  return tuple(int(v) for v in np.diff(np.concatenate([[0], ends])))


def to_blocks(shares: Sequence[int], global_batch: int, block: int) -> tuple[int, ...]:
  """Per-host block counts for block-aligned sample shares (see `check_aligned`)."""
  ends = np.cumsum(np.asarray(shares, np.int64))
  return tuple(int(v) for v in np.diff(np.concatenate([[0], -(-ends // block)])))


def nearest_aligned(shares: Sequence[int], global_batch: int, block: int) -> tuple[int, ...]:
  """The block-aligned split closest to `shares`: each host boundary rounded to a block."""
  ends = np.cumsum(np.asarray(shares, np.int64))
  ends = np.minimum(np.floor(ends / block + 0.5).astype(np.int64) * block, global_batch)
  ends[-1] = global_batch
  return tuple(int(v) for v in np.diff(np.concatenate([[0], ends])))


def check_aligned(shares: Sequence[int], global_batch: int, block: int) -> tuple[int, ...]:
  """Refuses a split whose host boundaries cut a block, naming the nearest valid one.

  A boundary is valid at a multiple of `block` or at the end of the batch.
  """
  shares = tuple(int(s) for s in shares)
  ends = np.cumsum(shares)
  bad = [i for i, e in enumerate(ends[:-1]) if e % block and e != global_batch]
  if bad:
    fix = ",".join(map(str, nearest_aligned(shares, global_batch, block)))
    raise ValueError(
        f"assignment {','.join(map(str, shares))} cuts a block of {block} samples (the "
        f"per-device micro-batch) after host {bad[0]}: every share must be a whole number of "
        f"blocks, so that BatchNorm groups and dropout masks do not depend on the split. "
        f"The nearest valid assignment is {fix}.")
  return shares


def first_block(shares: Sequence[int], host: int, block: int) -> int:
  """The global index of host `host`'s first block (its offset / `block`)."""
  return int(sum(shares[:host])) // block


class BlockBalancer:
  """Runs any balancer in blocks and hands the trainer sample shares: the wrapped balancer
  sees a "global batch" of `num_blocks` units, priced by each host's ladder (`ladders_of`),
  so its cost model and solver need no notion of samples."""

  def __init__(self, inner: Any, global_batch: int, block: int):
    self.inner, self.global_batch, self.block = inner, int(global_batch), int(block)
    self.name = getattr(inner, "name", type(inner).__name__)

  @property
  def decisions(self) -> list:
    """The inner balancer's decisions with shares in samples and `step` the first step
    (counted as the records count: 1 = the first) that runs them."""
    return [{**d, "step": d["step"] + 1,
             "shares": list(to_samples(d["shares"], self.global_batch, self.block))}
            for d in getattr(self.inner, "decisions", [])]

  def shares(self, step: int) -> tuple[int, ...]:
    return to_samples(self.inner.shares(step), self.global_batch, self.block)

  def observe(self, step: int, shares: Sequence[int], compute_s: Sequence[float]) -> None:
    self.inner.observe(step, to_blocks(shares, self.global_batch, self.block), compute_s)

  def state_dict(self) -> dict[str, Any]:
    return {"block": self.block, "inner": self.inner.state_dict()}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    if int(state.get("block", -1)) != self.block:
      raise ValueError(f"the balancer state was written for blocks of {state.get('block')} samples, "
                       f"this run has {self.block}.")
    self.inner.load_state_dict(state["inner"])


def ladders_of(devices_per_host: Sequence[int], device_batches: Sequence[int] | None = None,
               program_s: Sequence[Sequence[float] | None] | None = None) -> list[balancer_lib.Ladder]:
  """Every host's ladder in blocks: device rounds of `devices` blocks, device batches of `k`
  (default 1), priced by `program_s[h]`, the measured seconds of each program of its ladder
  `k, k/2, ..., 1` (none: by size alone)."""
  n = len(devices_per_host)
  ks = [1] * n if device_batches is None else [int(k) for k in device_batches]
  times = [None] * n if program_s is None else list(program_s)
  if len(ks) != n or len(times) != n:
    raise ValueError(f"device batches ({len(ks)}) and program times ({len(times)}) need one entry "
                     f"per host ({n} hosts).")
  return [balancer_lib.Ladder.of(int(d), k, t) for d, k, t in zip(devices_per_host, ks, times)]


def make_block_balancer(assignment: str | Sequence[int], global_batch: int, block: int,
                        devices_per_host: Sequence[int], *, mode: str | None = None,
                        device_batches: Sequence[int] | None = None,
                        program_s: Sequence[Sequence[float] | None] | None = None,
                        **options: Any) -> BlockBalancer:
  """`balancer.make_balancer`, in blocks; an explicit `assignment` (samples) must be aligned.
  `device_batches` and `program_s` (see `ladders_of`) matter to the profiling modes only."""
  if isinstance(assignment, str):
    assignment = balancer_lib.parse_assignment(assignment)
  if assignment != "equal":
    shares = balancer_lib.validate_shares(assignment, global_batch, len(devices_per_host))
    assignment = to_blocks(check_aligned(shares, global_batch, block), global_batch, block)
  if mode in ("static", "dynamic"):
    options["ladders"] = ladders_of(devices_per_host, device_batches, program_s)
  inner = balancer_lib.make_balancer(
      assignment, num_blocks(global_batch, block), len(devices_per_host), mode=mode,
      granularity=list(devices_per_host), **options)
  return BlockBalancer(inner, global_batch, block)
