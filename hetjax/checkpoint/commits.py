"""orbax's commit, watched: a write that fails, in the background too, is reported as it fails.

orbax reports a background write's failure only at the next save, while the
other hosts wait in its barrier (20 minutes). So the state handler's commit
futures call `report` as they fail, and the manager ends the job at once. The
same seam injects an EMULATED failure (`Faults.write_error`), as a full disk.
"""

from __future__ import annotations

from typing import Any, Callable

import orbax.checkpoint as ocp

Report = Callable[[int, BaseException], None]


class ReportingHandler:
  """orbax's standard handler (`handler`), whose commit futures report a failure; only its
  `async_save` is wrapped (orbax pairs argument and handler types). Set `step` before a save."""

  def __init__(self, report: Report,
               inject: Callable[[int], BaseException | None] | None = None):
    self.handler = ocp.StandardCheckpointHandler()
    self._report, self._inject = report, inject
    self.step: int | None = None
    original = self.handler.async_save

    async def async_save(directory: Any, *args: Any, **kwargs: Any) -> list[Any]:
      futures = list(await original(directory, *args, **kwargs) or [])
      step = self.step
      injected = None if self._inject is None or step is None else self._inject(step)
      if injected is not None:
        futures.append(_Failed(injected))
      return [_Reported(f, step, self._report) for f in futures]

    self.handler.async_save = async_save


class _Reported:
  """A commit future whose failure is reported before orbax sees it."""

  def __init__(self, inner: Any, step: int | None, report: Report):
    self._inner, self._step, self._report = inner, step, report

  def result(self, timeout: float | None = None) -> Any:
    try:
      return self._inner.result(timeout=timeout)
    except Exception as e:  # pylint: disable=broad-except
      if self._step is not None and not isinstance(e, TimeoutError):
        self._report(self._step, e)
      raise

  def cancel(self) -> Any:
    return getattr(self._inner, "cancel", lambda: None)()


class _Failed:
  """EMULATED: a commit that fails with `error` (`hetjax.cluster.emulate.Faults.write_error`)."""

  def __init__(self, error: BaseException):
    self._error = error

  def result(self, timeout: float | None = None) -> Any:
    del timeout
    raise self._error

  def cancel(self) -> None:
    pass
