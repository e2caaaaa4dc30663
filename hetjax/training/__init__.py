"""The pieces the Trainer and its modes are built from, one job a file (below
`hetjax.modes`, above the step's programs)."""
