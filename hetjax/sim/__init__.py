"""A cluster simulator at scale, pure numpy, driving the real balancer (SIMULATED figures).

`sync`: synchronous steps; `rounds`: hybrid rounds; `price`: what a micro-batch size costs.
"""

from hetjax.sim.sync import (ASSUMPTIONS, DEFAULT_MIX, GPU_SPEED, ClusterSpec,  # noqa: F401
                             SimResult, auto_device_batches, ideal_best_device_batch_samples_per_s,
                             ideal_samples_per_s, make, mix, optimal_shares, simulate,
                             single_host_samples_per_s)
