"""Checkpoints: orbax saves of everything a run needs to continue exactly
(`manager`), the pinned-host snapshot that lets a save overlap training
(`snapshot`), and orbax's commit watched so that a write failing on one host,
in the background too, ends every host at once (`commits`)."""

import importlib as _importlib


def __getattr__(name: str):
  # `hetjax.checkpoint.CheckpointConfig` and friends, loaded only when asked
  # for: the manager imports orbax.
  return getattr(_importlib.import_module("hetjax.checkpoint.manager"), name)
