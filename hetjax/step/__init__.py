"""The compiled programs of one training step, and the one update rule.

Why a package of its own: everything that runs on the devices for a sync
step lives here, below the trainer and above the mesh (`hetjax.mesh`), so
the programs can be read, tested and counted without the loop around them.

- `state.py`: what a step carries (`TrainState`) and sums (`Sums`), and how
  one device's sums travel as one float32 row (`Layout`, `LocalSums`).
- `block.py`: one block's per-example sums; blocks keyed by their global
  index, whichever device runs them (invariant 2).
- `local.py`: the LOCAL program (`LocalProgram`), `jit(shard_map)` over this
  host's devices only: the previous update applied, then the host's share
  in fixed-shape micro-batches of whole blocks. No cross-host collective,
  so hosts may run different numbers of them (invariant 4).
- `reduction.py`: the CROSS-HOST program (`DeviceReduction`, or
  `HostReduction` over CPU collectives): every device's row summed, the
  step's statistics, and the small per-host vector every host reads
  (invariant 3).
- `update.py`: the update rule (`optimizer_step`), one for the whole state,
  its slices and the rounds modes' local steps.
- `sharding.py`: the sharded update (ZeRO stage 1): each slice of the state
  updated by one device inside the reduction, then gathered, so replicas
  stay bit-identical on hosts that compile differently (invariant 6).
- `packing.py`, `precision.py`, `device_batch.py`: packing trees into rows,
  bf16 / fp16 compute with float32 masters, and `--device-batch auto`.
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
