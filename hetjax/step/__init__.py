"""The compiled programs of one training step, and the one update rule.

Everything that runs on the devices for a sync step, below the trainer and above `hetjax.mesh`,
so the programs can be read, tested and counted without the loop around them: the LOCAL program
(`local.py`, this host's devices only, so hosts may run different numbers of micro-batches:
invariant 4), the CROSS-HOST reduction (`reduction.py`, invariant 3), the update rule
(`update.py`) and the sharded update (`sharding.py`, invariant 6).
"""

from hetjax.step.state import Layout, LocalSums, Sums, TrainState, init_state
from hetjax.step.block import block_sums, blocks_sums, micro_batches, padded_chunks
from hetjax.step.local import Local, LocalProgram
from hetjax.step.update import apply_update, optimizer_step, overflowed, step_stats, summed_row
from hetjax.step.reduction import (DeviceReduction, HostReduction, Reduced, make_reduction)

__all__ = ["DeviceReduction", "HostReduction", "Layout", "Local", "LocalProgram", "LocalSums",
           "Reduced", "Sums", "TrainState", "apply_update", "block_sums", "blocks_sums",
           "init_state", "make_reduction", "micro_batches", "optimizer_step", "overflowed",
           "padded_chunks", "step_stats", "summed_row"]
