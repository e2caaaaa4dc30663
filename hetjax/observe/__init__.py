"""What a run tells its user: metrics sinks, the bounded history, the progress
line and the report picture. numpy and matplotlib only, never JAX."""
