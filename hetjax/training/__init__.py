"""The pieces the Trainer and its modes are built from, one job a file: the
run lifecycle every mode shares (`lifecycle`), this host's replica of the
sync state (`replica`), the sync step pipeline (`pipeline`), the named
columns of a reduction's host vector (`host_vector`), the hosts' agreement
checks (`agreement`), device-readiness stamps (`readiness`) and evaluation
(`evaluate`). Below `hetjax.modes`, above the step's programs."""
