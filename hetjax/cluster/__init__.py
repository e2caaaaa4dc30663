"""The process family: launching and supervising hosts, joining, stop signals, the watchdog,
emulation, the doctor. Only `runtime` and `doctor` import JAX: `launch/` starts hosts without it.
"""
