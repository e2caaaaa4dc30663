"""Per-step metrics on disk: OUT/metrics.jsonl and TensorBoard event files.

One record per step, in the schema below (`RECORD_KEYS`). The trainer emits
it one step late, because the wait of step `s` is only known after the
collective of step `s + 1` (`RecordStream` does that bookkeeping), and the
last one at close. Only process 0 writes.

The TensorBoard event file is written here, not through tensorboardX or
TensorFlow: a scalar event is ten lines of protobuf wire format, and owning
them keeps hetjax off the protobuf version that tensorflow-datasets pins.

Example:
  >>> with MetricsWriter("runs/latest") as writer:
  ...   writer.write(record)
"""

from __future__ import annotations

import json
import numbers
import os
import socket
import struct
import time
from typing import Any, Callable, Iterable, Sequence

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"

# The record schema: key -> kind. Every record has exactly these keys.
RECORD_KEYS = {
    "step": "int",            # absolute step index
    "time_s": "float",        # training seconds since the stream started, at the end of the step
    "loss": "float",
    "metrics": "floats",      # {name: float}; the loss is not repeated here
    "samples_per_sec": "float",  # global_batch / step_s
    "step_s": "float",
    "global_batch": "int",
    "shares": "host_ints",    # samples per host; they sum to global_batch
    "compute_s": "host_floats",
    "wait_s": "host_floats",
    "emulated": "bool",       # host speeds were emulated (hetjax.emulate)
}
# Keys a record has only sometimes: the learning rate when the optimizer
# exposes it (optax.inject_hyperparams), the evaluation figures on the steps
# after which the trainer evaluated (measured after the step, off its clock).
OPTIONAL_KEYS = {
    "lr": "float",
    "eval": "floats",
}


# ---- Records -------------------------------------------------------------


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_float(x: Any) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_bool(x: Any) -> bool:
  return type(x).__name__ in ("bool", "bool_")  # Python's or numpy's.


def _is_floats(x: Any) -> bool:
  return isinstance(x, dict) and all(isinstance(k, str) and _is_float(v) for k, v in x.items())


def _host_list(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda x: isinstance(x, (list, tuple)) and all(check(v) for v in x)


# kind -> (check, conversion to plain Python, what the check wants)
_KINDS = {
    "int": (_is_int, int, "an int"),
    "float": (_is_float, float, "a number"),
    "bool": (_is_bool, bool, "a bool"),
    "floats": (_is_floats, lambda x: {k: float(v) for k, v in x.items()},
               "a dict of name -> number"),
    "host_ints": (_host_list(_is_int), lambda x: [int(v) for v in x],
                  "a list with one int per host"),
    "host_floats": (_host_list(_is_float), lambda x: [float(v) for v in x],
                    "a list with one number per host"),
}


def validate_record(record: dict[str, Any]) -> dict[str, Any]:
  """Checks `record` against `RECORD_KEYS`; returns it as plain Python types.

  Raises:
    ValueError: a missing or unknown key, a wrong type, per-host lists of
      different lengths, or shares that do not sum to the global batch. Schema
      drift between the trainer and the readers should fail here, loudly.
  """
  if not isinstance(record, dict):
    raise ValueError(f"a metrics record must be a dict, got {type(record).__name__}.")
  where = f"metrics record for step {record.get('step', '?')}"
  missing = sorted(set(RECORD_KEYS) - set(record))
  unknown = sorted(set(record) - set(RECORD_KEYS) - set(OPTIONAL_KEYS))
  if missing or unknown:
    raise ValueError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown}; the schema "
                     "is hetjax.metrics.RECORD_KEYS (change it there and in its readers together).")
  out: dict[str, Any] = {}
  for key, kind in RECORD_KEYS.items():
    check, convert, want = _KINDS[kind]
    if not check(record[key]):
      raise ValueError(f"{where}: {key!r} must be {want}, got {record[key]!r}.")
    out[key] = convert(record[key])
  for key, kind in OPTIONAL_KEYS.items():
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
  """Reads and validates a metrics.jsonl file (or the run folder holding one).

  A torn last line, as a crashed run leaves, is dropped; a bad line anywhere
  else is an error that names it.
  """
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

  A record for history index `i` is complete once `wait_s[i]` is known: one
  step late, and for the last step after `Trainer.summary()` gathered it.
  `time_s` is the running sum of `step_s` (seconds spent in steps). A new
  stream starts after the records already complete, so each `fit` call can
  make its own.
  """

  def __init__(self, history: Any, *, global_batch: int, emulated: bool, first_step: int = 0,
               sinks: Sequence[Callable[[dict[str, Any]], Any]] = ()):
    """Args:
      history: a `hetjax.trainer.History` (read, never changed).
      global_batch: samples per step.
      emulated: whether host speeds are emulated.
      first_step: the absolute step of history index 0 (non-zero after resume).
      sinks: callables fed each new record, e.g. `MetricsWriter.write`.
    """
    self._history, self._sinks = history, list(sinks)
    self._global_batch, self._emulated, self._first_step = global_batch, emulated, first_step
    # Records complete before this stream began were someone else's to emit
    # (an earlier `fit` call); the clock keeps running from them.
    # A bounded history (hetjax.history) drops old steps: index i is entry i - dropped.
    self._next = self._ready()
    kept = self._next - self._dropped()
    folded = getattr(getattr(history, "folded", None), "time_s", 0.0)
    self._time_s = folded + float(sum(history.step_s[:kept]))

  def _dropped(self) -> int:
    return getattr(self._history, "dropped", 0)

  def _ready(self) -> int:
    h = self._history
    return self._dropped() + min(len(h.shares), len(h.compute_s), len(h.wait_s), len(h.step_s))

  def pop(self) -> list[dict[str, Any]]:
    """The records completed since the last call, also handed to every sink."""
    h, ready, dropped = self._history, self._ready(), self._dropped()
    records = []
    for i in range(max(self._next, dropped), ready):
      k = i - dropped
      self._time_s += h.step_s[k]
      metrics = {name: v for name, v in h.metrics[k].items() if name != "loss"}
      record = {
          "step": self._first_step + i, "time_s": self._time_s, "loss": h.loss[k],
          "metrics": metrics, "samples_per_sec": self._global_batch / h.step_s[k] if h.step_s[k] > 0 else 0.0,
          "step_s": h.step_s[k], "global_batch": self._global_batch, "shares": list(h.shares[k]),
          "compute_s": list(h.compute_s[k]), "wait_s": list(h.wait_s[k]),
          "emulated": self._emulated}
      lr = getattr(h, "lr", {})
      if lr.get(i) is not None:
        record["lr"] = lr[i]
      evals = getattr(h, "evals", {})
      if i in evals:
        record["eval"] = evals[i]
      records.append(validate_record(record))
    self._next = max(self._next, ready)
    for record in records:
      for sink in self._sinks:
        sink(record)
    return records


# ---- TensorBoard event files ---------------------------------------------


def _crc32c_table() -> list[int]:
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), the checksum of TFRecord framing."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC, so that CRCs of CRCs do not degenerate."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """One TFRecord: length, masked CRC of the length, data, masked CRC of the data."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
  return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
  return _field(number, 2, _varint(len(data)) + data)


def event_bytes(wall_time: float, step: int, *, file_version: str | None = None,
                scalars: dict[str, float] | None = None) -> bytes:
  """A `tensorflow.Event` proto: wall_time=1, step=2, file_version=3, summary=5.

  Scalars use `Summary.Value.simple_value` (tag=1, simple_value=2), which
  TensorBoard reads as scalars.
  """
  out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))
        for tag, value in scalars.items())
    out += _bytes_field(5, values)
  return out


class EventFileWriter:
  """Appends scalar events to one `events.out.tfevents.*` file, flushed per event."""

  def __init__(self, log_dir: str):
    os.makedirs(log_dir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.hetjax"
    self.path = os.path.join(log_dir, name)
    self._file = open(self.path, "ab")
    self._write(event_bytes(time.time(), 0, file_version="brain.Event:2"))

  def _write(self, event: bytes) -> None:
    self._file.write(tfrecord(event))
    self._file.flush()

  def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
    self._write(event_bytes(time.time() if wall_time is None else wall_time, step, scalars=scalars))

  def close(self) -> None:
    self._file.close()


def read_events(path: str) -> list[dict[str, Any]]:
  """Parses an event file written by `EventFileWriter`, checking every CRC.

  Returns one dict per event: `wall_time`, `step`, and `file_version` or
  `scalars` ({tag: value}). For tests and for reading runs without TensorBoard.
  """
  with open(path, "rb") as f:
    data = f.read()
  events, pos = [], 0
  while pos < len(data):
    (length,) = struct.unpack_from("<Q", data, pos)
    (length_crc,) = struct.unpack_from("<I", data, pos + 8)
    body = data[pos + 12:pos + 12 + length]
    (body_crc,) = struct.unpack_from("<I", data, pos + 12 + length)
    if length_crc != masked_crc32c(data[pos:pos + 8]) or body_crc != masked_crc32c(body):
      raise ValueError(f"{path}: bad CRC in the record at byte {pos}; the file is corrupt.")
    events.append(_parse_event(body))
    pos += 16 + length
  return events


def _fields(data: bytes) -> Iterable[tuple[int, int, Any]]:
  pos = 0
  while pos < len(data):
    key, pos = _read_varint(data, pos)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, pos = _read_varint(data, pos)
    elif wire == 1:
      value, pos = data[pos:pos + 8], pos + 8
    elif wire == 5:
      value, pos = data[pos:pos + 4], pos + 4
    elif wire == 2:
      n, pos = _read_varint(data, pos)
      value, pos = data[pos:pos + n], pos + n
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} in an event.")
    yield number, wire, value


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
  result, shift = 0, 0
  while True:
    byte = data[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return result, pos


def _parse_event(body: bytes) -> dict[str, Any]:
  event: dict[str, Any] = {}
  for number, _, value in _fields(body):
    if number == 1:
      event["wall_time"] = struct.unpack("<d", value)[0]
    elif number == 2:
      event["step"] = value
    elif number == 3:
      event["file_version"] = value.decode()
    elif number == 5:
      scalars = event.setdefault("scalars", {})
      for _, _, item in _fields(value):
        parts = {n: v for n, _, v in _fields(item)}
        scalars[parts[1].decode()] = struct.unpack("<f", parts[2])[0]
  return event


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
  """Writes each step's record to OUT/metrics.jsonl and OUT/tensorboard/.

  Only process 0 should build one. Every line is flushed as it is written,
  so a run that crashes keeps every step it finished. A NaN loss is written
  as `NaN` (Python's json reads it back; it is the signal, not an error).
  """

  def __init__(self, out_dir: str, *, tensorboard: bool = True, resume_step: int | None = None):
    """Args:
      out_dir: the run's output folder (created if missing).
      tensorboard: also write TensorBoard scalars under OUT/tensorboard/.
      resume_step: a resumed run keeps the earlier records of steps before
        this one (those after it were redone from the checkpoint); None
        starts the file afresh.
    """
    os.makedirs(out_dir, exist_ok=True)
    self.out_dir = out_dir
    self.path = os.path.join(out_dir, METRICS_FILE)
    kept = []
    if resume_step is not None and os.path.exists(self.path):
      kept = [r for r in read_records(self.path) if r["step"] < resume_step]
    self._file = open(self.path, "w")
    for record in kept:
      self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()
    self._events = EventFileWriter(os.path.join(out_dir, TENSORBOARD_DIR)) if tensorboard else None

  def write(self, record: dict[str, Any]) -> None:
    """Validates and appends one step's record; raises ValueError on schema drift."""
    if self._file.closed:
      raise ValueError(f"MetricsWriter for {self.path} is closed; write before close().")
    record = validate_record(record)
    self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()
    if self._events is not None:
      self._events.add_scalars(record["step"], scalars_of(record))

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
