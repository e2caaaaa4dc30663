"""The input pipeline: sampler, sources, TFDS on disk, the host loader, errors."""

import json
import pickle
import subprocess
import sys
import threading
import tracemalloc
import types

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hetjax.input import augment
from hetjax.input import data
from hetjax.input import loader
from hetjax.input import sources
from hetjax.input import tfds_data

AUG = augment.parse("crop,flip")


def _numbered(n: int) -> sources.ArraySource:
  """Records whose pixels and `i` name the record, so any mix-up shows."""
  x = (np.arange(n, dtype=np.float32)[:, None, None, None] * 100
       + np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1))
  return sources.ArraySource({"x": x, "i": np.arange(n)}, sources.DatasetInfo("numbered", "custom"))


def _equal(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ---- Sampler ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 9, 64, 100, 1000, 1025])
def test_each_epoch_is_a_permutation(n):
  for seed in (0, 1, 12345):
    sampler = data.GlobalSampler(n, 1, seed)
    for epoch in range(3):
      got = sampler.at(np.arange(epoch * n, (epoch + 1) * n))
      np.testing.assert_array_equal(np.sort(got), np.arange(n))


def test_the_shuffle_differs_between_epochs_and_seeds():
  a, b = data.GlobalSampler(1000, 10, 0), data.GlobalSampler(1000, 10, 1)
  first = a.at(np.arange(1000))
  assert not np.array_equal(first, a.at(np.arange(1000, 2000)))
  assert not np.array_equal(first, b.at(np.arange(1000)))
  assert not np.array_equal(first, np.arange(1000))


def test_a_billion_records_shuffle_in_constant_memory():
  sampler = data.GlobalSampler(10**9, 4096, seed=7)
  tracemalloc.start()
  try:
    late = sampler.indices(10**7)  # Position 4e10: the 40th epoch.
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 4 * 2**20
  assert len(np.unique(late)) == 4096 and late.min() >= 0 and late.max() < 10**9
  assert sampler.epochs_completed(10**7) == 40


def test_batches_cross_epoch_boundaries_and_epochs_count_exactly():
  sampler = data.GlobalSampler(10, 4, seed=3)
  stream = np.concatenate([sampler.indices(s) for s in range(5)])  # 20 positions, 2 epochs.
  np.testing.assert_array_equal(np.sort(stream[:10]), np.arange(10))
  np.testing.assert_array_equal(np.sort(stream[10:]), np.arange(10))
  assert [sampler.epochs_completed(s) for s in (2, 3, 5, 7)] == [0, 1, 2, 2]


def test_the_cursor_round_trips_and_refuses_another_stream():
  sampler = data.GlobalSampler(1437, 96, seed=5)
  state = json.loads(json.dumps(sampler.state_dict(17)))
  again = data.GlobalSampler(1437, 96, seed=5)
  assert again.restore(state) == 17
  np.testing.assert_array_equal(again.indices(17), sampler.indices(17))
  for other, message in ((data.GlobalSampler(1437, 96, seed=6), "seed=5 but this run has seed=6"),
                         (data.GlobalSampler(1000, 96, seed=5), "num_records=1437 but this run has"),
                         (data.GlobalSampler(1437, 64, seed=5), "global_batch=96 but this run has")):
    with pytest.raises(ValueError, match=message):
      other.restore(state)


# ---- Host slices through the loader ----------------------------------------


def _split(draw, total: int, hosts: int) -> tuple[int, ...]:
  cuts = sorted(draw(st.lists(st.integers(0, total), min_size=hosts - 1, max_size=hosts - 1)))
  return tuple(int(b - a) for a, b in zip([0] + cuts, cuts + [total]))


@st.composite
def _scenario(draw):
  n = draw(st.integers(1, 40))
  batch = draw(st.integers(1, n))
  hosts = draw(st.integers(1, 4))
  steps = sorted(set(draw(st.lists(st.integers(0, 3 * n // batch + 2), min_size=1, max_size=4))))
  actual = [_split(draw, batch, hosts) for _ in steps]
  guesses = [_split(draw, batch, hosts) for _ in steps]
  return n, batch, steps, actual, guesses, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(_scenario())
def test_host_batches_rebuild_the_one_host_batch_despite_wrong_guesses(scenario):
  n, batch, steps, actual, guesses, with_aug = scenario
  source, aug = _numbered(n), (AUG if with_aug else None)
  sampler = data.GlobalSampler(n, batch, seed=11)
  hosts = len(actual[0])
  one_host = loader.HostLoader(source, sampler, 0, augment=aug)
  many = [loader.HostLoader(source, sampler, h, augment=aug, min_chunk=2) for h in range(hosts)]
  try:
    for k, step in enumerate(steps):
      for h, host in enumerate(many):
        host.prefetch(step, guesses[k])  # A guess, usually wrong.
      parts = [host.get(step, actual[k]) for host in many]
      assert [len(p["i"]) for p in parts] == list(actual[k])
      whole = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
      _equal(whole, one_host.get(step, (batch,)))
      np.testing.assert_array_equal(whole["i"], sampler.indices(step))
  finally:
    for host in many + [one_host]:
      host.close()


def test_a_right_guess_is_served_from_the_prefetch_and_a_wrong_one_is_patched():
  source = _numbered(50)
  sampler = data.GlobalSampler(50, 32, seed=0)
  with loader.HostLoader(source, sampler, 1, min_chunk=4) as host:
    host.prefetch(0, (8, 16, 8))
    _equal(host.get(0, (8, 16, 8)), host.read(0, (8, 16, 8)))
    assert host.stats == {"prefetched": 16, "read_on_demand": 0, "read_inline": 0}
    host.prefetch(1, (8, 16, 8))
    _equal(host.get(1, (4, 24, 4)), host.read(1, (4, 24, 4)))  # 16 reused, 8 read now.
    assert host.stats == {"prefetched": 32, "read_on_demand": 8, "read_inline": 0}
    assert len(host.get(2, (32, 0, 0))["i"]) == 0  # A share of zero.


def test_an_example_is_augmented_the_same_alone_or_in_any_batch():
  source = _numbered(30)
  indices, epochs = np.arange(30), np.full(30, 4)
  whole = AUG(source[indices], augment.example_keys(0, epochs, indices))
  for i in range(30):
    alone = AUG(source[indices[i:i + 1]], augment.example_keys(0, epochs[i:i + 1], indices[i:i + 1]))
    np.testing.assert_array_equal(alone["x"][0], whole["x"][i])
  next_epoch = AUG(source[indices], augment.example_keys(0, epochs + 1, indices))
  assert not np.array_equal(next_epoch["x"], whole["x"])
  assert not np.array_equal(whole["x"], source[indices]["x"])


class _Broken:
  info = sources.DatasetInfo("broken", "custom")

  def __len__(self):
    return 40

  def __getitem__(self, indices):
    if 13 in indices:
      raise OSError("record 13 is unreadable")
    return {"i": np.asarray(indices)}


def test_a_worker_error_surfaces_in_get_and_no_thread_outlives_close():
  sampler = data.GlobalSampler(40, 40, seed=0)
  host = loader.HostLoader(_Broken(), sampler, 0, threads=2, min_chunk=1)
  other = loader.HostLoader(_Broken(), sampler, 0)  # Its threads are not the first one's.
  other.prefetch(1, (40,))
  host.prefetch(0, (40,))
  assert host.running() >= 1  # Its own reader threads (the pool starts them as work comes).
  with pytest.raises(OSError, match="record 13 is unreadable"):
    host.get(0, (40,))
  host.close()
  host.close()
  assert host.running() == 0
  assert other.running() > 0
  other.close()
  assert not [t for t in threading.enumerate() if t.name.startswith(host.thread_prefix)]
  with pytest.raises(RuntimeError, match="closed"):
    host.get(1, (40,))


# ---- Sources -----------------------------------------------------------------


def test_digits_keep_their_exact_values():
  train, test = data.load("digits"), data.load("digits", "test")
  assert (len(train), len(test)) == (1437, 360)
  batch = train[np.arange(1437)]
  assert batch["x"].dtype == np.float32 and batch["x"].shape == (1437, 8, 8, 1)
  assert batch["y"].dtype == np.int32
  assert set(np.unique(batch["x"] * 16)) <= set(range(17))
  from sklearn.datasets import load_digits  # The oracle: scikit-learn's own reader.
  digits = load_digits()
  order = np.random.default_rng(0).permutation(1797)
  np.testing.assert_array_equal(batch["x"][..., 0] * 16, digits.images[order[:1437]])
  np.testing.assert_array_equal(batch["y"], digits.target[order[:1437]])


def test_digits_without_scikit_learn_say_what_to_install(monkeypatch):
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  with pytest.raises(FileNotFoundError, match="pip install scikit-learn"):
    data.load("digits")


def test_the_big_synthetic_dataset_computes_records_from_their_index():
  big = data.load("synthetic_big")
  assert len(big) == 10**7 and big.info.kind == "image"
  idx = np.array([9_999_999, 0, 123_456_789 % 10**7, 5])
  batch = big[idx]
  for j, i in enumerate(idx):
    _equal({k: v[0] for k, v in big[np.array([i])].items()}, {k: v[j] for k, v in batch.items()})
  labels = big[np.arange(2000)]["y"]
  assert len(np.unique(labels)) == 10
  assert data.load("synthetic_big", "test")[np.array([0])]["x"].tolist() != batch["x"][1:2].tolist()


def test_the_name_check_runs_before_jax_and_tfds_load():
  code = ("import sys; from hetjax import data; data.check_dataset_name('digits')\n"
          "try: data.check_dataset_name('tfds:mnist', '/nonexistent')\n"
          "except ValueError: pass\n"
          "print('jax' in sys.modules, 'tensorflow_datasets' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["False", "False"]


# ---- TFDS ------------------------------------------------------------------


def test_a_dataset_built_offline_reads_back_through_the_catalog_path(tmp_path):
  import tensorflow_datasets as tfds

  x = (np.arange(12 * 28 * 28) % 251).reshape(12, 28, 28, 1).astype(np.uint8)
  y = np.arange(12) % 10
  features = {"image": tfds.features.Image(shape=(28, 28, 1)), "label": tfds.features.ClassLabel(num_classes=10)}
  tfds_data.build_from_arrays("mnist", {"train": {"image": x, "label": y},
                                        "test": {"image": x[:3], "label": y[:3]}},
                              str(tmp_path), version="3.0.1", features=features)
  # The catalog's own MNIST builder opens these files: the path a real download takes.
  assert type(tfds.builder("mnist", data_dir=str(tmp_path))).__module__.endswith("image_classification.mnist")
  source = data.load("tfds:mnist", "train", data_dir=str(tmp_path))
  assert len(source) == 12 and source.info == sources.DatasetInfo("tfds:mnist", "image", num_classes=10)
  batch = source[np.array([5, 0, 11])]
  assert batch["x"].dtype == np.uint8  # Pixels travel as bytes; the model scales them on the device.
  np.testing.assert_array_equal(batch["x"], x[[5, 0, 11]])
  np.testing.assert_array_equal(batch["y"], [5, 0, 1])
  sampler = data.GlobalSampler(len(source), 8, seed=0)
  with loader.HostLoader(source, sampler, 1) as host:
    host.prefetch(1, (3, 5))
    _equal(host.get(1, (3, 5)), source[sampler.indices(1)[3:]])


def test_digits_survive_a_tfds_round_trip_exactly(tmp_path):
  import tensorflow_datasets as tfds

  digits = data.load("digits")
  tfds_data.build_from_arrays(
      "hetjax_digits", {"train": digits.arrays}, str(tmp_path),
      features={"x": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.float32),
                "y": tfds.features.ClassLabel(num_classes=10)})
  source = data.load("tfds:hetjax_digits", data_dir=str(tmp_path))
  assert source.info.kind == "image" and source.info.num_classes == 10
  _equal(source[np.arange(len(digits))], digits.arrays)


def test_a_slice_of_records_is_parsed_as_one_batch_in_any_order_and_dtype(tmp_path):
  rng = np.random.default_rng(0)
  arrays = {"a": rng.integers(-300, 300, (40, 3)).astype(np.int16), "b": rng.random(40) < 0.5,
            "c": rng.standard_normal((40, 2, 2)), "d": rng.integers(0, 2**40, 40)}
  tfds_data.build_from_arrays("mixed", {"train": arrays}, str(tmp_path))
  source = data.load("tfds:mixed", data_dir=str(tmp_path))
  order = np.array([39, 3, 3, 0, 17])  # Unsorted, repeated: read in file order, given back in this one.
  got = source[order]
  stored = {**arrays, "c": arrays["c"].astype(np.float32).astype(np.float64)}  # tf.Example's float_list.
  _equal(got, {k: v[order] for k, v in stored.items()})
  assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in arrays.items()}
  assert {k: v.shape[1:] for k, v in source[np.array([], np.int64)].items()} == {
      k: v.shape[1:] for k, v in arrays.items()}


# ---- Errors ------------------------------------------------------------------


def _tfrecord_dataset(root):
  folder = root / "old" / "1.0.0"
  folder.mkdir(parents=True)
  (folder / "dataset_info.json").write_text(json.dumps({"name": "old", "splits": [{"name": "train"}]}))


@pytest.mark.parametrize("name, split, data_dir, message", [
    ("nope", "train", None, "unknown dataset 'nope'; choose one of digits"),
    ("digits", "validation", None, "dataset 'digits' has splits 'train' and 'test', not 'validation'"),
    ("synthetic_big", "dev", None, "dataset 'synthetic_big' has splits 'train' and 'test'"),
    ("tfds:mnist", "train", "MISSING", "TFDS data folder .* \\(for dataset 'mnist'\\) does not exist"),
    ("tfds:mnist", "train", "TMP", "TFDS dataset 'mnist' is not prepared in .*tfds build mnist"),
    ("tfds:old", "train", "TMP", "TFDS dataset 'old' .* is stored as tfrecord, which has no random access"),
    ("tfds:Bad Name", "train", "TMP", "is not of the form name"),
])
def test_dataset_errors_name_the_dataset_and_the_fix(tmp_path, name, split, data_dir, message):
  _tfrecord_dataset(tmp_path)
  data_dir = {"MISSING": str(tmp_path / "absent"), "TMP": str(tmp_path)}.get(data_dir)
  with pytest.raises(ValueError, match=message):
    data.check_dataset_name(name, data_dir, split)
  with pytest.raises(ValueError, match=message):
    data.load(name, split, data_dir=data_dir)


def test_a_missing_tfds_split_is_refused(tmp_path):
  tfds_data.build_from_arrays("tiny", {"train": {"v": np.arange(4.0)}}, str(tmp_path))
  with pytest.raises(ValueError, match="TFDS dataset 'tiny' has no split 'test'; its splits are train"):
    data.load("tfds:tiny", "test", data_dir=str(tmp_path))


def test_records_of_varying_shape_are_refused_before_training(tmp_path):
  import tensorflow_datasets as tfds

  images = [np.zeros((5, 5, 1), np.uint8), np.zeros((6, 4, 1), np.uint8)]
  features = {"image": tfds.features.Image(shape=(None, None, 1))}
  tfds_data.build_from_arrays("ragged", {"train": {"image": np.array(images, dtype=object)}},
                              str(tmp_path), features=features)
  with pytest.raises(ValueError, match="feature 'image' has shape \\(None, None, 1\\).*pass --image-size S"):
    data.load("tfds:ragged", data_dir=str(tmp_path))


def test_too_small_a_dataset_is_refused_with_its_name():
  with pytest.raises(ValueError, match="dataset 'digits' has 1437 records, fewer than one global batch \\(2048\\)"):
    data.GlobalSampler(1437, 2048, 0, name="digits")


def test_records_that_disagree_with_the_model_are_refused():
  digits = data.load("digits")
  sources.check_records(digits, {"x": ((8, 8, 1), "float32"), "y": ((), "int32")})
  sources.check_records(digits, {"x": ((None, None, 1), np.float32)})
  with pytest.raises(ValueError, match="dataset 'digits' record 0: 'x' has shape \\(8, 8, 1\\) and dtype "
                                       "float32, but the model expects shape \\(28, 28, 1\\)"):
    sources.check_records(digits, {"x": ((28, 28, 1), "float32")})
  with pytest.raises(ValueError, match="records have arrays \\['x', 'y'\\], but the model needs 'image'"):
    sources.check_records(digits, {"image": ((8, 8, 1), "float32")})
  assert sources.record_spec(digits) == {"x": ((8, 8, 1), np.float32), "y": ((), np.int32)}


def test_records_of_a_split_over_several_files_are_read_at_their_global_index(tmp_path):
  """A split that spans shards and skips into them (TFDS's file instructions, as for
  'train[150:]'): global index i is the i-th record of the instructions, whatever the order."""
  from array_record.python import array_record_module
  paths = []
  for shard in range(3):
    paths.append(str(tmp_path / f"d.array_record-0000{shard}-of-00003"))
    writer = array_record_module.ArrayRecordWriter(paths[-1], "group_size:1")
    for r in range(100):
      writer.write(f"{shard}:{r}".encode())
    writer.close()
  parts = [types.SimpleNamespace(filename=paths[0], skip=50, take=50),
           types.SimpleNamespace(filename=paths[1], skip=0, take=100),
           types.SimpleNamespace(filename=paths[2], skip=0, take=30)]
  info = types.SimpleNamespace(file_format="FileFormat.ARRAY_RECORD",
                               splits={"train[150:]": types.SimpleNamespace(file_instructions=parts)})
  records = tfds_data._Records(types.SimpleNamespace(dataset_info=info, split="train[150:]"))
  expected = [f"0:{r}" for r in range(50, 100)] + [f"1:{r}" for r in range(100)] + [
      f"2:{r}" for r in range(30)]
  keys = np.random.default_rng(0).permutation(180)
  assert [r.decode() for r in records.read(keys)] == [expected[k] for k in keys]
  again = pickle.loads(pickle.dumps(records))  # As a loader worker gets it: opens its own.
  assert [r.decode() for r in again.read(keys[:7])] == [expected[k] for k in keys[:7]]
