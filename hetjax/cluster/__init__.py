"""The process family: launching and supervising hosts, joining the cluster,
stop signals, the run-wide watchdog (a deadline on every wait, one host's
verdict ending every host), emulated speeds and faults, the doctor and the
multi-host test harness.

Only `runtime` (joining) and `doctor` import JAX; the launcher's modules are
stdlib alone, so `launch/` starts hosts without paying for JAX.
"""
