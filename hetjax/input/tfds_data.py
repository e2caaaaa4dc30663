"""TFDS datasets prepared on disk, read at random without TensorFlow.

`tfds_source` opens a dataset prepared as array_record in `data_dir` (random access: each host
reads only its records; nothing downloaded at run time). `build_from_arrays` writes the layout
`tfds build --file_format=array_record` writes, so both go through one path. Images of varying
size stay encoded (`EncodedImages`), decoded by `hetjax.input.images` on the loader's workers.
`check` reads only `dataset_info.json`: bad folders or splits fail in ms, before JAX starts.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import pathlib
import re
from typing import Any, Mapping

import numpy as np

from hetjax.input.sources import Batch, DatasetInfo, Source

READABLE_FORMATS = ("array_record", "parquet")  # What tfds.data_source can open.
_VERSION = re.compile(r"^\d+\.\d+\.\d+$")
_IMAGE_KEYS, _LABEL_KEYS = ("image", "x"), ("label", "y")


def default_data_dir() -> str:
  """TFDS's own default: $TFDS_DATA_DIR, else ~/tensorflow_datasets."""
  return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


def _parse(spec: str) -> tuple[str, str | None, str | None]:
  """'name[/config][:version]' -> (name, config, version)."""
  body, _, version = spec.partition(":")
  name, _, config = body.partition("/")
  if not re.fullmatch(r"[a-z0-9_]+", name) or (version and not _VERSION.match(version)):
    raise ValueError(f"TFDS dataset {spec!r} is not of the form name[/config][:1.2.3] "
                     "(lower-case catalog name, e.g. 'mnist' or 'mnist:3.0.1').")
  return name, config or None, version or None


def find_prepared(spec: str, data_dir: str | None = None) -> pathlib.Path:
  """The folder holding `spec`'s `dataset_info.json`; ValueError if absent."""
  root = pathlib.Path(data_dir or default_data_dir())
  name, config, version = _parse(spec)
  if not root.is_dir():
    raise ValueError(f"TFDS data folder {str(root)!r} (for dataset {spec!r}) does not exist; pass "
                     "--data-dir with the folder where the dataset was prepared.")
  base = root / name / config if config else root / name
  candidates = [base / version] if version else (
      sorted((p for p in base.iterdir() if _VERSION.match(p.name)),
             key=lambda p: tuple(int(v) for v in p.name.split(".")), reverse=True)
      if base.is_dir() else [])
  for folder in candidates:
    if (folder / "dataset_info.json").is_file():
      return folder
  found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name != "downloads")
  raise ValueError(f"TFDS dataset {spec!r} is not prepared in {str(root)!r} (looked for "
                   f"{str(base)}/{version or '<version>'}/dataset_info.json; that folder holds "
                   f"{found or 'no datasets'}). Prepare it there first, on a machine with network "
                   f"(`tfds build {name} --data_dir {root} --file_format array_record`) or from "
                   "local arrays (`hetjax.input.tfds_data.build_from_arrays`).")


def check(spec: str, split: str = "train", data_dir: str | None = None) -> dict[str, Any]:
  """The parsed `dataset_info.json`, after fast checks with no TFDS import: prepared,
  random-access format, split exists."""
  folder = find_prepared(spec, data_dir)
  info = json.loads((folder / "dataset_info.json").read_text())
  fmt = info.get("fileFormat", "tfrecord")
  if fmt not in READABLE_FORMATS:
    raise ValueError(f"TFDS dataset {spec!r} in {str(folder)!r} is stored as {fmt}, which has no "
                     f"random access; prepare it again with --file_format array_record.")
  splits = [s["name"] for s in info.get("splits", [])]
  for part in split.split("+"):
    base = part.split("[", 1)[0].strip()
    if base not in splits:
      raise ValueError(f"TFDS dataset {spec!r} has no split {base!r}; its splits are "
                       f"{', '.join(splits) or 'none'}.")
  return info


def _image_and_label(features: Any) -> tuple[str, str] | None:
  """The image feature (`image` or `x`) and class label (`label` or `y`), if both exist."""
  tfds = _tfds()
  image = next((k for k in _IMAGE_KEYS if k in features.keys()), None)
  label = next((k for k in _LABEL_KEYS if k in features.keys()
                and isinstance(features[k], tfds.features.ClassLabel)), None)
  if image and label and len(features[image].shape) in (2, 3):
    return image, label
  return None


class _Records:
  """A split's serialized records by index: one `read(positions)` a file and slice.

  Why: TFDS's `__getitem__` makes one call into array_record a record, its
  `__getitems__` starts a thread pool a call (96 digits: 1.5 / 1.25 ms,
  against 0.71 for the reader's own `read`). array_record's public reader
  where the split is array_record files; TFDS's source otherwise (parquet).
  Pickles as paths: a worker opens its own readers.
  """

  def __init__(self, data_source: Any):
    self._ds, self._readers = data_source, {}
    info = data_source.dataset_info
    parts = info.splits[data_source.split].file_instructions
    self._files = ([(os.fspath(f.filename), f.skip) for f in parts]
                   if str(info.file_format).lower().endswith("array_record") else None)
    self._ends = np.cumsum([f.take for f in parts]) if self._files else None

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_readers": {}}

  def read(self, indices: np.ndarray) -> list[bytes]:
    keys = np.asarray(indices, np.int64).reshape(-1)
    if self._files is None:
      return [self._ds[i] for i in keys.tolist()]
    if len(self._files) == 1:  # Most splits of a small dataset: no grouping by file.
      return self._reader(0).read((keys + self._files[0][1]).tolist())
    which, records = np.searchsorted(self._ends, keys, side="right"), [b""] * keys.size
    for f in np.unique(which).tolist():
      at = np.flatnonzero(which == f)
      first = int(self._ends[f - 1]) if f else 0
      positions = (keys[at] - first + self._files[f][1]).tolist()
      for i, record in zip(at.tolist(), self._reader(f).read(positions)):
        records[i] = record
    return records

  def _reader(self, f: int) -> Any:
    if f not in self._readers:  # No read-ahead, no thread pool: a slice reads at random.
      from array_record.python import array_record_module
      self._readers[f] = array_record_module.ArrayRecordReader(
          self._files[f][0], "readahead_buffer_size:0,max_parallelism:0",
          file_reader_buffer_size=32768)
    return self._readers[f]


def _examples(records: list[Any]) -> list[Any]:
  from tensorflow_datasets.proto import tf_example_pb2  # TFDS's own copy: no TensorFlow.
  return [tf_example_pb2.Example.FromString(r) for r in records]


def _plain(feature: Any) -> bool:
  """Stored as its own numbers (no encoding), so a batch of them is read as one array."""
  tfds = _tfds()
  info, dtype = feature.get_serialized_info(), np.dtype(feature.np_dtype)
  return (type(feature) in (tfds.features.Tensor, tfds.features.ClassLabel, tfds.features.Scalar)
          and tuple(info.shape) == tuple(feature.shape) and None not in tuple(feature.shape)
          and dtype.kind in "biuf" and dtype != np.uint64)


def _column(examples: list[Any], key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """Feature `key` of every example as one `[n, *shape]` array: C-level walks, no per-record numpy."""
  size, lists = math.prod(shape), [e.features.feature[key] for e in examples]
  if dtype.kind == "f" and size:  # Packed float32s: one buffer, past each list's fixed header.
    packed = [f.float_list.SerializeToString() for f in lists]
    width = len(packed[0]) if packed else 0
    if all(len(b) == width for b in packed) and width > 4 * size:
      flat = np.frombuffer(b"".join(packed), np.uint8).reshape(len(lists), width)[:, width - 4 * size:]
      return np.ascontiguousarray(flat).view("<f4").reshape(len(lists), *shape).astype(dtype)
  kind, flat_type = ("float_list", np.float32) if dtype.kind == "f" else ("int64_list", np.int64)
  values = ((getattr(f, kind).value[0] for f in lists) if size == 1 else  # Labels: 2x faster.
            itertools.chain.from_iterable(getattr(f, kind).value for f in lists))
  flat = np.fromiter(values, flat_type, count=len(lists) * size)
  return flat.reshape(len(lists), *shape).astype(dtype)


class TfdsSource:
  """A prepared TFDS split of fixed-shape records as a hetjax source.

  An `image`/`x` plus a class-label `label`/`y` becomes an image source (`x` keeps its dtype,
  uint8 scaled on the device; 2-D images get a channel axis; `y` int32); anything else keeps
  its names and dtypes ("custom"). Plain-number features are parsed as one array per batch,
  without TFDS's per-record decode; encoded ones (PNG) are decoded record by record.
  """

  def __init__(self, data_source: Any, spec: str):
    self._ds = data_source  # Opened with RAW_BYTES: this class parses the records.
    self._records = _Records(data_source)
    features = data_source.dataset_info.features
    self._raw = {}
    for key in features.keys():
      feature = features[key]
      shape = tuple(feature.shape)
      if any(d is None for d in shape):
        hint = ("pass --image-size S (Python: image_size=S) to decode, crop and resize them to "
                "S x S" if isinstance(feature, _tfds().features.Image) else
                "resize them offline into a new dataset (hetjax.input.tfds_data.build_from_arrays)")
        raise ValueError(f"TFDS dataset {spec!r}: feature {key!r} has shape {shape}, so its records "
                         f"differ in shape and cannot form fixed-shape batches; {hint}.")
      self._raw[key] = (shape, np.dtype(feature.np_dtype), _plain(feature))
    self._keys = _image_and_label(features)
    self.info = (DatasetInfo(f"tfds:{spec}", "image",
                             num_classes=features[self._keys[1]].num_classes)
                 if self._keys else DatasetInfo(f"tfds:{spec}", "custom"))

  def __len__(self) -> int:
    return len(self._ds)

  def __getitem__(self, indices: np.ndarray) -> Batch:
    records = self._records.read(indices)
    examples = _examples(records)
    decoded = None if all(p for _, _, p in self._raw.values()) else [
        self._ds.dataset_info.features.deserialize_example_np(r) for r in records]
    raw = {k: _column(examples, k, shape, dtype) if plain else
           np.stack([np.asarray(d[k], dtype) for d in decoded]) if records else
           np.zeros((0, *shape), dtype) for k, (shape, dtype, plain) in self._raw.items()}
    if not self._keys:
      return raw
    x, label = raw[self._keys[0]], raw[self._keys[1]]
    return {"x": x if x.ndim == 4 else x[..., None], "y": label.astype(np.int32)}


class EncodedImages:
  """A TFDS image-classification split with its images left encoded (JPEG/PNG bytes).

  `source[indices] -> {"image": object array of bytes, "label": int32}`; decoded by
  `images.ImageSource` on the loader's workers. Pickles small (files reopened by path).
  """

  def __init__(self, data_source: Any, spec: str, keys: tuple[str, str]):
    self._ds, self._keys = data_source, keys  # Opened with RAW_BYTES.
    self._records = _Records(data_source)
    features = data_source.dataset_info.features
    self.channels = int(features[keys[0]].shape[-1]) if len(features[keys[0]].shape) == 3 else 1
    self.info = DatasetInfo(f"tfds:{spec}", "image", num_classes=features[keys[1]].num_classes)

  def __len__(self) -> int:
    return len(self._ds)

  def __getitem__(self, indices: np.ndarray) -> Batch:
    examples = _examples(self._records.read(indices))
    blobs = np.empty(len(examples), dtype=object)
    blobs[:] = [e.features.feature[self._keys[0]].bytes_list.value[0] for e in examples]
    return {"image": blobs, "label": _column(examples, self._keys[1], (), np.dtype(np.int32))}


def _tfds():
  import tensorflow_datasets as tfds
  return tfds


def tfds_source(spec: str, split: str = "train", data_dir: str | None = None, *,
                image_size: int | None = None, augment: str | None = None) -> Source:
  """A catalog (or `build_from_arrays`) dataset prepared in `data_dir`.

  Args:
    spec: 'name[/config][:version]', e.g. 'mnist' or 'imagenet2012:5.1.0'.
    split: a split name; TFDS slices such as 'train[:90%]' work too.
    data_dir: the folder it was prepared in (default: TFDS's default).
    image_size: decode, crop and resize the images to this square size
      (`hetjax.input.images`); needed for images of varying size (ImageNet).
    augment: with `image_size`, the training randomness: 'none', 'crop'
      (random resized crop), 'flip' or 'crop,flip'.
  """
  check(spec, split, data_dir)
  tfds = _tfds()  # ~1 s; only once the cheap checks passed.
  folder = data_dir or default_data_dir()
  raw = tfds.decode.DeserializeMethod.RAW_BYTES  # Parsed in bulk here, not record by record.
  if image_size is None:
    return TfdsSource(tfds.data_source(spec, split=split, data_dir=folder, download=False,
                                       deserialize_method=raw), spec)
  from hetjax.input import images

  builder = tfds.builder(spec, data_dir=folder)
  keys = _image_and_label(builder.info.features)
  if keys is None:
    raise ValueError(f"--image-size needs an image-classification dataset (an 'image' and a "
                     f"'label' feature); TFDS dataset {spec!r} has {sorted(builder.info.features.keys())}.")
  ds = tfds.data_source(spec, split=split, data_dir=folder, download=False, deserialize_method=raw)
  encoded = EncodedImages(ds, spec, keys)
  recipe = images.recipe_from_augment(image_size, encoded.channels, augment)
  return images.ImageSource(encoded, recipe)


IMAGE_FORMATS = ("png", "jpeg")


def _encoder(feature: Any):
  """numpy -> what the feature's encoder takes without TensorFlow."""
  import tensorflow_datasets as tfds
  from PIL import Image  # TFDS encodes images with TF; encoded bytes pass through untouched.

  if not isinstance(feature, tfds.features.Image):
    return lambda v: v
  fmt = "JPEG" if feature.encoding_format == "jpeg" else "PNG"

  def encode(v: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    v = np.asarray(v, np.uint8)
    Image.fromarray(v[..., 0] if v.ndim == 3 and v.shape[-1] == 1 else v).save(
        buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()

  return encode


def _image_features(splits: Mapping[str, Mapping[str, Any]], image_format: str) -> dict[str, Any]:
  """`image` as variable-size encoded images, `label` as a class label."""
  tfds = _tfds()
  if image_format not in IMAGE_FORMATS:
    raise ValueError(f"image_format must be one of {', '.join(IMAGE_FORMATS)}, got {image_format!r}.")
  for split, arrays in splits.items():
    if set(arrays) != {"image", "label"}:
      raise ValueError(f"build_from_arrays(image_format={image_format!r}): split {split!r} has "
                       f"{sorted(arrays)}; give exactly 'image' (uint8 [h, w, c] each) and 'label'.")
  first = np.asarray(next(iter(splits.values()))["image"][0])
  channels = first.shape[-1] if first.ndim == 3 else 1
  classes = 1 + max(int(np.max(a["label"])) for a in splits.values() if len(a["label"]))
  return {"image": tfds.features.Image(shape=(None, None, channels), encoding_format=image_format),
          "label": tfds.features.ClassLabel(num_classes=classes)}


def build_from_arrays(name: str, splits: Mapping[str, Mapping[str, np.ndarray]], data_dir: str, *,
                      version: str = "1.0.0", features: Mapping[str, Any] | None = None,
                      image_format: str | None = None,
                      description: str = "Built offline by hetjax from numpy arrays.") -> pathlib.Path:
  """Prepares numpy arrays as a TFDS dataset (array_record), offline.

  Record `i` of a split is `{key: arrays[key][i]}`, in order (no shuffling).

  Args:
    name: the dataset name to read it back by (a catalog name is allowed:
      the catalog's builder then reads these files).
    splits: `{split: {key: array [n, ...]}}`.
    data_dir: the data folder; the dataset lands in `data_dir/name/version`.
    version: 'major.minor.patch'.
    features: `{key: tfds.features.FeatureConnector}`; default: a
      `tfds.features.Tensor` of each array's record shape and dtype.
      `tfds.features.Image` arrays are encoded with PIL (PNG, or JPEG when
      the feature says so).
    image_format: 'jpeg' or 'png': the splits hold `image` (a list of uint8
      `[h, w, c]` arrays whose sizes may differ) and `label` (ints), stored
      as a variable-size image feature and a class label, like ImageNet in
      the catalog (read them with `--image-size`).

  Returns:
    The folder holding the prepared dataset.
  """
  tfds = _tfds()
  _parse(f"{name}:{version}")
  if not splits:
    raise ValueError(f"build_from_arrays({name!r}): give at least one split, e.g. {{'train': arrays}}.")
  first = next(iter(splits.values()))
  if image_format is not None and features is None:
    features = _image_features(splits, image_format)
  features = dict(features) if features else {
      k: tfds.features.Tensor(shape=v.shape[1:], dtype=v.dtype) for k, v in first.items()}
  for split, arrays in splits.items():
    lengths = {k: len(v) for k, v in arrays.items()}
    if set(arrays) != set(features) or len(set(lengths.values())) > 1:
      raise ValueError(f"build_from_arrays({name!r}): split {split!r} has arrays {lengths}; every "
                       f"split needs the keys {sorted(features)}, all of one length.")
  target = pathlib.Path(data_dir) / name / version
  if target.exists():
    raise ValueError(f"{str(target)!r} already exists; delete it or choose another version.")
  encoders = {k: _encoder(f) for k, f in features.items()}

  class _Arrays(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """TFDS's AdhocBuilder checks `isinstance(x, tf.data.Dataset)`; this one needs no TF."""

    VERSION = tfds.core.Version(version)

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, description=description, disable_shuffling=True,
                                   features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(arrays) for split, arrays in splits.items()}

    def _generate_examples(self, arrays):
      for i in range(len(next(iter(arrays.values())))):
        yield i, {k: encoders[k](v[i]) for k, v in arrays.items()}

  _Arrays.name = name
  builder = _Arrays(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(download_dir=os.path.join(data_dir, "downloads"))
  return target
