"""The process family: launching and supervising hosts, joining the cluster,
stop signals, emulated speeds, the doctor and the multi-host test harness.

Only `runtime` (joining) and `doctor` import JAX; the launcher's modules are
stdlib alone, so `launch/` starts hosts without paying for JAX.
"""
