"""Per-step metrics on disk: OUT/metrics.jsonl and TensorBoard event files.

One record per step (`RECORD_KEYS`), emitted two steps late: the wait of step
`s` travels in the collective of step `s + 2` (`RecordStream`). Only process 0
writes. TensorBoard goes through `tensorboardX` (no TensorFlow needed).
"""

from __future__ import annotations

import json
import numbers
import os
from typing import Any, Callable, Sequence

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"

# The record schema: key -> kind. Every record has exactly these keys.
RECORD_KEYS = {
    "step": "int",            # steps done, counting this one (1 = the first), as --steps counts
    "time_s": "float",        # training seconds since the stream started, at the end of the step
    "loss": "float",
    "metrics": "floats",      # {name: float}; the loss is not repeated here
    "samples_per_sec": "float",  # global_batch / step_s
    "step_s": "float",
    "global_batch": "int",
    "shares": "host_ints",    # samples per host; they sum to global_batch
    "compute_s": "host_floats",
    "wait_s": "host_floats",
    "emulated": "bool",       # host speeds were emulated (hetjax.cluster.emulate)
}
# Keys a record has only sometimes: the learning rate (optax.inject_hyperparams), and the
# evaluation after the steps the trainer evaluated at (off the step's clock).
OPTIONAL_KEYS = {"lr": "float", "eval": "floats"}


# ---- Records -------------------------------------------------------------


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_float(x: Any) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _host_list(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda x: isinstance(x, (list, tuple)) and all(check(v) for v in x)


# kind -> (check, conversion to plain Python, what the check wants)
_KINDS = {
    "int": (_is_int, int, "an int"),
    "float": (_is_float, float, "a number"),
    "bool": (lambda x: type(x).__name__ in ("bool", "bool_"), bool, "a bool"),  # Python's, numpy's.
    "floats": (lambda x: isinstance(x, dict) and all(isinstance(k, str) and _is_float(v)
                                                     for k, v in x.items()),
               lambda x: {k: float(v) for k, v in x.items()}, "a dict of name -> number"),
    "host_ints": (_host_list(_is_int), lambda x: [int(v) for v in x],
                  "a list with one int per host"),
    "host_floats": (_host_list(_is_float), lambda x: [float(v) for v in x],
                    "a list with one number per host"),
}


def validate_record(record: dict[str, Any]) -> dict[str, Any]:
  """Checks `record` against `RECORD_KEYS`; returns it as plain Python types.

  Raises:
    ValueError: a missing or unknown key, a wrong type, per-host lists of different
      lengths, or shares that do not sum to the global batch (schema drift, loudly).
  """
  if not isinstance(record, dict):
    raise ValueError(f"a metrics record must be a dict, got {type(record).__name__}.")
  where = f"metrics record for step {record.get('step', '?')}"
  missing = sorted(set(RECORD_KEYS) - set(record))
  unknown = sorted(set(record) - set(RECORD_KEYS) - set(OPTIONAL_KEYS))
  if missing or unknown:
    raise ValueError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}; the schema "
                     "is hetjax.observe.metrics.RECORD_KEYS (change it there and in its readers together).")
  out: dict[str, Any] = {}
  for key, kind in {**RECORD_KEYS, **OPTIONAL_KEYS}.items():
    if key in record:
      check, convert, want = _KINDS[kind]
      if not check(record[key]):
        raise ValueError(f"{where}: {key!r} must be {want}, got {record[key]!r}.")
      out[key] = convert(record[key])
  hosts = {k: len(out[k]) for k in ("shares", "compute_s", "wait_s")}
  if len(set(hosts.values())) != 1 or not out["shares"]:
    raise ValueError(f"{where}: shares, compute_s and wait_s need one entry per host (at least "
                     f"one host), got lengths {hosts}.")
  if sum(out["shares"]) != out["global_batch"]:
    raise ValueError(f"{where}: shares {out['shares']} sum to {sum(out['shares'])}, not the "
                     f"global batch {out['global_batch']}.")
  return out


def read_records(path: str) -> list[dict[str, Any]]:
  """Reads and validates a metrics.jsonl file (or the run folder holding one); a torn last
  line (a crashed run's) is dropped, a bad line elsewhere is an error naming it."""
  if os.path.isdir(path):
    path = os.path.join(path, METRICS_FILE)
  with open(path) as f:
    lines = f.read().split("\n")
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      records.append(validate_record(json.loads(line)))
    except json.JSONDecodeError as e:
      if number == len(lines):
        break  # No newline after it: the run died while writing it.
      raise ValueError(f"{path}, line {number} is not JSON ({e}).") from None
    except ValueError as e:
      raise ValueError(f"{path}, line {number}: {e}") from None
  return records


class RecordStream:
  """Turns the trainer's growing `History` into complete per-step records.

  A record is complete once its `wait_s` is known (one step late; the last one
  after `Trainer.summary()`). `time_s` sums `step_s`. A stream starts after the
  records already complete, so each `fit` call can make its own.
  """

  def __init__(self, history: Any, *, global_batch: int | None, emulated: bool, first_step: int = 0,
               sinks: Sequence[Callable[[dict[str, Any]], Any]] = (),
               extra: Callable[[int], dict[str, float]] | None = None):
    """`history` is read, never changed; `global_batch` None: each step's shares' sum (a
    round's); `first_step`: the step of history index 0 (after a resume); `sinks` get each new
    record; `extra(k)`: a mode's own metrics of window entry k (the rounds modes' taus)."""
    self._history, self._sinks, self._extra = history, list(sinks), extra
    self._global_batch, self._emulated, self._first_step = global_batch, emulated, first_step
    # Records complete before this stream were an earlier `fit`'s; the clock runs on from them.
    # A bounded history drops old steps: index i is entry i - dropped.
    self._next = self._ready()
    kept = self._next - history.dropped
    self._time_s = history.folded.time_s + float(sum(history.step_s[:kept]))

  def _ready(self) -> int:
    h = self._history
    return h.dropped + min(len(h.shares), len(h.compute_s), len(h.wait_s), len(h.step_s))

  def pop(self) -> list[dict[str, Any]]:
    """The records completed since the last call, also handed to every sink."""
    h, ready, dropped = self._history, self._ready(), self._history.dropped
    records = []
    for i in range(max(self._next, dropped), ready):
      k = i - dropped
      self._time_s += h.step_s[k]
      metrics = {name: v for name, v in h.metrics[k].items() if name != "loss"}
      metrics.update(self._extra(k) if self._extra else {})
      batch = self._global_batch or sum(h.shares[k])
      record = {
          "step": self._first_step + i + 1, "time_s": self._time_s, "loss": h.loss[k],
          "metrics": metrics, "samples_per_sec": batch / h.step_s[k] if h.step_s[k] > 0 else 0.0,
          "step_s": h.step_s[k], "global_batch": batch, "shares": list(h.shares[k]),
          "compute_s": list(h.compute_s[k]), "wait_s": list(h.wait_s[k]),
          "emulated": self._emulated}
      if h.lr.get(i) is not None:
        record["lr"] = h.lr[i]
      if i in h.evals:
        record["eval"] = h.evals[i]
      records.append(validate_record(record))
    self._next = max(self._next, ready)
    for record in records:
      for sink in self._sinks:
        sink(record)
    return records


# ---- TensorBoard ------------------------------------------------------------


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
  """The TensorBoard scalars of one record, by tag."""
  out = {"loss": record["loss"], "samples_per_sec": record["samples_per_sec"],
         "step_s": record["step_s"]}
  out.update({f"metrics/{k}": v for k, v in record["metrics"].items()})
  if "lr" in record:
    out["lr"] = record["lr"]
  out.update({f"eval/{k}": v for k, v in record.get("eval", {}).items()})
  for i, (share, compute, wait) in enumerate(zip(record["shares"], record["compute_s"], record["wait_s"])):
    out.update({f"host{i}/share": float(share), f"host{i}/compute_s": compute, f"host{i}/wait_s": wait})
  return out


# ---- The writer ----------------------------------------------------------


class MetricsWriter:
  """Writes each step's record to OUT/metrics.jsonl and OUT/tensorboard/ (process 0 only).

  Every line is flushed, so a crashed run keeps every step it finished. A NaN
  loss is written as `NaN` (Python's json reads it back; it is the signal).
  """

  def __init__(self, out_dir: str, *, tensorboard: bool = True, resume_step: int | None = None):
    """`resume_step`: the checkpoint's step a run resumed from, whose later records are dropped
    (redone); None starts the file afresh."""
    os.makedirs(out_dir, exist_ok=True)
    self.out_dir = out_dir
    self.path = os.path.join(out_dir, METRICS_FILE)
    kept = []
    if resume_step is not None and os.path.exists(self.path):
      kept = [r for r in read_records(self.path) if r["step"] <= resume_step]
    self._file = open(self.path, "w")
    for record in kept:
      self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()
    self._events = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # Only process 0 pays for the import.
      self._events = SummaryWriter(os.path.join(out_dir, TENSORBOARD_DIR))

  def write(self, record: dict[str, Any]) -> None:
    """Validates and appends one step's record; raises ValueError on schema drift."""
    if self._file.closed:
      raise ValueError(f"MetricsWriter for {self.path} is closed; write before close().")
    record = validate_record(record)
    self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()
    if self._events is not None:
      for tag, value in scalars_of(record).items():
        self._events.add_scalar(tag, value, record["step"])
      self._events.flush()  # As the jsonl: a crashed run keeps every step it finished.

  def close(self) -> None:
    if not self._file.closed:
      self._file.close()
      if self._events is not None:
        self._events.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def write_summary(out_dir: str, summary: dict[str, Any]) -> str:
  """Writes OUT/summary.json (numpy values as lists); returns its path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, SUMMARY_FILE)
  with open(path, "w") as f:
    json.dump(summary, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
  return path
