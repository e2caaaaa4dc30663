"""A cluster simulator at scale, pure numpy, driving the real balancer.

`sync` models synchronous steps (the balancer's world); `rounds` models the
hybrid mode's rounds on the same cluster. SIMULATED figures, always labelled.
"""

from hetjax.sim.sync import (ASSUMPTIONS, DEFAULT_MIX, GPU_SPEED, ClusterSpec,  # noqa: F401
                             SimResult, ideal_samples_per_s, make, mix, optimal_shares,
                             simulate, single_host_samples_per_s)
