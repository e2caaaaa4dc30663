"""The pieces a trainer is built from: the run lifecycle every mode shares,
the hosts' agreement checks, device-readiness stamps and evaluation."""
