"""Multi-host tests on one machine: the public face of `hetjax.cluster.testing`."""

from hetjax.cluster.testing import (KilledRun, host_pid, kill_a_host_mid_run,  # noqa: F401
                                    killed_and_uninterrupted, run_hosts)
from hetjax.cluster.warm_client import command as module_command  # noqa: F401
