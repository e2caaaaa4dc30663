"""The compiled programs of one training step (where arrays live: `hetjax.mesh`).

LOCAL (`LocalProgram`): `jit(shard_map)` over this host's own devices, where
the train state lives (replicated over them). The first micro-batch's
program first applies the previous step's update (`apply_update`) from the
summed row the reduction left, then every micro-batch adds its gradients.
The host's share, a whole number of blocks of `m` positions
(`hetjax.blocks`), is fed as fixed-shape micro-batches of `j` blocks per
device, `j` from the host's ladder `k, k/2, ..., 1` (`k` its device batch;
the last micro-batch padded and masked), the blocks of a device kept
apart; each device keeps running sums of per-example gradients, losses,
metrics, weights and the count of real examples. A block's PRNG key is
`fold_in(fold_in(key(seed), step), block)`, whichever device runs it. No cross-host collective runs here, so hosts may
run different numbers of micro-batches, and a new share changes only how
often the same compiled programs run (invariant 4).

CROSS-HOST (`DeviceReduction` / `HostReduction`): the per-device rows are
stitched, zero-copy, into one global array of shape `[all devices, ...]`;
one small program sums them (invariant 2: the update divides
`sum(grad sums)` by `sum(counts)`) and computes the step's statistics. In a
world of one device the summed row is the next update, applied by the next
step's first local program. In a larger world the same program also runs
the sharded update (`hetjax.sharding`, ZeRO stage 1): each device updates
its slice of every parameter, model-state and optimizer-state leaf, and the
new parameters and model state are all-gathered and packed, so every bit of
every replica comes from one computation, however differently the hosts
compile (issue 25); the next local program unpacks them. The host backend
runs it over its CPU mesh (one device per host).

Every host contributes one row per local device, so hosts may even have
different numbers of devices. The rows also carry a small host vector
(timings, stop requests, shares): each device row of host `h` ends with host
`h`'s values, so every host learns every host's values from the same
collective (invariant 3).

Per-step work does not grow with the number of parameter arrays: each
device's sums are one float32 row, so they cross to the world mesh as one
array and come back as one; the state never leaves the host's devices. A
step launches one program per micro-batch and one reduction, and re-wraps
at most two arrays (none in a one-device world), for 6 leaves or 600. What
a step sends from the host beyond the user's arrays travels in one small
int32 array per micro-batch (`_POSITION`): each device's step, block,
number of real examples (its mask is built on the device) and the host
vector, so a step makes as many transfers as a plain loop's batch has
arrays. Under `precision` bf16 / fp16
the local program computes in the low type from float32 master parameters;
sums, the reduction and the update stay float32.
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
