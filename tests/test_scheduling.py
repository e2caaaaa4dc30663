"""The suite's order over its two workers (tests/_scheduling.py): whole units, longest first."""

import json
import types

import _scheduling


def _items(*nodeids):
  return [types.SimpleNamespace(nodeid=n) for n in nodeids]


def test_units_go_longest_first_and_keep_their_tests_together_in_order(tmp_path, monkeypatch):
  table = tmp_path / "durations.json"
  table.write_text(json.dumps({"test_short.py": 1.0, "test_long.py": 50.0,
                               "test_exactness.py": 20.0, "test_device_batch.py": 40.0}))
  monkeypatch.setattr(_scheduling, "TABLE", str(table))
  items = _items("tests/test_short.py::a", "tests/test_device_batch.py::b",
                 "tests/test_long.py::c", "tests/test_exactness.py::d",
                 "tests/test_new.py::e", "tests/test_long.py::f", "tests/test_device_batch.py::g")
  _scheduling.longest_first(items)
  # The exactness runs' files are one unit (40 + 20 + 10 + 10 s: a file not in the table
  # counts 10 s).
  assert [i.nodeid for i in items] == [
      "tests/test_device_batch.py::b", "tests/test_exactness.py::d",
      "tests/test_device_batch.py::g", "tests/test_long.py::c", "tests/test_long.py::f",
      "tests/test_new.py::e", "tests/test_short.py::a"]
  assert {_scheduling.unit_of(i.nodeid) for i in items[:3]} == {_scheduling.EXACT_UNIT}


def test_the_recorder_adds_up_each_files_seconds(tmp_path):
  recorder = _scheduling.DurationRecorder(str(tmp_path / "out.json"))
  for nodeid, seconds in (("tests/test_a.py::x", 1.5), ("tests/test_a.py::y", 2.0),
                          ("tests/test_b.py::z", 5.0)):
    recorder.pytest_runtest_logreport(types.SimpleNamespace(nodeid=nodeid, duration=seconds))
  recorder.pytest_sessionfinish()
  assert json.loads((tmp_path / "out.json").read_text()) == {"test_b.py": 5.0, "test_a.py": 3.5}
