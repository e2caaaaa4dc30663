"""The pieces a trainer is built from: this host's replica of the state, the
sync step pipeline and its checkpoints, the run lifecycle every mode shares,
the hosts' agreement checks, device-readiness stamps and evaluation."""
