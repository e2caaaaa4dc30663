"""A checkpoint that cannot be written: one message on every host, and its exit code.

A full disk is the usual cause and a restart cannot help, so the message says
all a user needs to act. No JAX: it is built from what the manager measured.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

from hetjax.config import is_remote
from hetjax.exits import WRITE_FAILED_EXIT, JobExit


class CheckpointWriteFailed(JobExit):
  """A checkpoint could not be written; every host stops with one message naming the folder,
  the free space against a checkpoint's size, the last good checkpoint (left intact), what
  may be deleted and the command that resumes. The command line exits `WRITE_FAILED_EXIT`."""

  exit_code = WRITE_FAILED_EXIT

  def __init__(self, message: str, step: int | None = None, directory: str | None = None):
    super().__init__(message)
    self.step, self.directory = step, directory


class WriteError(Exception):
  """A save that failed on the worker thread: its step and orbax's error, described later."""

  def __init__(self, step: int, cause: BaseException, nbytes: int):
    super().__init__(str(cause))
    self.step, self.cause, self.nbytes = step, cause, nbytes


def message(directory: str, step: int | None, cause: BaseException | None,
            size: int | None, last_good: int | None) -> str:
  """The one text of a failed write of `directory`/`step` (`cause` None: another host's)."""
  cause = "it failed on another host" if cause is None else _first_line(cause)
  text = (f"cannot write checkpoint {directory}/{step}: {cause}. "
          f"Free space there: {_free_space(directory)}; a checkpoint takes about "
          f"{_megabytes(size)}. ")
  if last_good is None:
    text += "No earlier checkpoint is complete; the run must start afresh. "
  else:
    text += f"The last good checkpoint, {directory}/{last_good}, is intact. "
  partial = _partial_folders(directory)
  if partial:
    text += f"The unfinished {', '.join(partial)} there may be deleted. "
  return text + (f"Free space (or point --ckpt-dir at a larger disk, copying that checkpoint "
                 f"along), then resume with: {_resume_command()}  (exit code {WRITE_FAILED_EXIT})")


def folder_bytes(path: str) -> int | None:
  """Bytes under a local step folder (None for a URL or an unreadable folder)."""
  if is_remote(path):
    return None
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total or None


def _partial_folders(directory: str) -> list[str]:
  """orbax's unfinished step folders (STEP.orbax-checkpoint-tmp...) in a local folder."""
  if is_remote(directory):
    return []
  try:
    return sorted(n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n)
  except OSError:
    return []


def _megabytes(n: int | None) -> str:
  if not n:
    return "an unknown size"
  return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _free_space(directory: str) -> str:
  if is_remote(directory):
    return "unknown (a URL)"
  try:
    return f"{shutil.disk_usage(directory).free / 1e6:.1f} MB"
  except OSError:
    return "unknown"


def _first_line(error: BaseException) -> str:
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  text = lines[0] if lines else type(error).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def _resume_command() -> str:
  """This process's command, as a user would type it again (it resumes from the newest)."""
  argv = list(sys.argv)
  if not argv or argv[0] == "-c":
    return "the same command again"
  if os.path.basename(argv[0]) == "hetjax":
    argv[0] = "hetjax"
  elif argv and argv[0].endswith(".py"):
    argv = ["python"] + argv
  return shlex.join(argv) if argv else "the same command"
