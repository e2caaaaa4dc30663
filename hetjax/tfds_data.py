"""TFDS datasets prepared on disk, read at random without TensorFlow.

`tfds_source("mnist", "train", data_dir)` opens any catalog dataset already
prepared in `data_dir` in the array_record format through `tfds.data_source`
(random access: each host reads only its records). Nothing is downloaded at
run time. `build_from_arrays` prepares such a dataset offline from numpy
arrays, with the same layout `tfds build --file_format=array_record` writes,
so a dataset made here and a catalog dataset go through one path.

`check` reads only `dataset_info.json`, so the command line can refuse a
missing folder, dataset or split in milliseconds, before JAX starts.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
from typing import Any, Mapping

import numpy as np

from hetjax.sources import Batch, DatasetInfo

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
                   "local arrays (`hetjax.tfds_data.build_from_arrays`).")


def check(spec: str, split: str = "train", data_dir: str | None = None) -> dict[str, Any]:
  """Fast checks, no TFDS import: prepared, random-access format, split exists.

  Returns:
    The parsed `dataset_info.json`.
  """
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


class TfdsSource:
  """A prepared TFDS split as a hetjax source (`len`, `info`, `source[indices]`).

  A dataset with an `image` (or `x`) and a class-label `label` (or `y`)
  becomes an image-classification source: `x` float32 (uint8 pixels scaled
  to [0, 1], a channel axis added to 2-D images), `y` int32. Any other
  dataset keeps its feature names and dtypes (kind "custom").
  """

  def __init__(self, data_source: Any, spec: str):
    import tensorflow_datasets as tfds

    self._ds = data_source
    features = data_source.dataset_info.features
    self._raw = {}
    for key in features.keys():
      feature = features[key]
      shape = tuple(feature.shape)
      if any(d is None for d in shape):
        raise ValueError(f"TFDS dataset {spec!r}: feature {key!r} has shape {shape}, so its records "
                         "differ in shape and cannot form fixed-shape batches; resize them offline "
                         "into a new dataset (hetjax.tfds_data.build_from_arrays).")
      self._raw[key] = (shape, np.dtype(feature.np_dtype))
    image = next((k for k in _IMAGE_KEYS if k in self._raw), None)
    label = next((k for k in _LABEL_KEYS
                  if k in self._raw and isinstance(features[k], tfds.features.ClassLabel)), None)
    self._keys = (image, label) if image and label and len(self._raw[image][0]) in (2, 3) else None
    if self._keys:
      self.info = DatasetInfo(f"tfds:{spec}", "image", num_classes=features[label].num_classes)
    else:
      self.info = DatasetInfo(f"tfds:{spec}", "custom")

  def __len__(self) -> int:
    return len(self._ds)

  def __getitem__(self, indices: np.ndarray) -> Batch:
    keys = [int(i) for i in np.asarray(indices).reshape(-1)]
    records = self._ds.__getitems__(keys) if keys else []
    raw = {k: (np.stack([np.asarray(r[k], dtype) for r in records]) if records
               else np.zeros((0, *shape), dtype)) for k, (shape, dtype) in self._raw.items()}
    if not self._keys:
      return raw
    image, label = raw[self._keys[0]], raw[self._keys[1]]
    x = image.astype(np.float32) / np.float32(255) if image.dtype == np.uint8 else image.astype(np.float32)
    return {"x": x if x.ndim == 4 else x[..., None], "y": label.astype(np.int32)}


def tfds_source(spec: str, split: str = "train", data_dir: str | None = None) -> TfdsSource:
  """A catalog (or `build_from_arrays`) dataset prepared in `data_dir`.

  Args:
    spec: 'name[/config][:version]', e.g. 'mnist' or 'mnist:3.0.1'.
    split: a split name; TFDS slices such as 'train[:90%]' work too.
    data_dir: the folder it was prepared in (default: TFDS's default).
  """
  check(spec, split, data_dir)
  import tensorflow_datasets as tfds  # ~1 s; only once the cheap checks passed.

  ds = tfds.data_source(spec, split=split, data_dir=data_dir or default_data_dir(), download=False)
  return TfdsSource(ds, spec)


def _encoder(feature: Any):
  """numpy -> what the feature's encoder takes without TensorFlow."""
  import tensorflow_datasets as tfds
  from PIL import Image  # TFDS encodes images with TF; PNG bytes pass through untouched.

  if not isinstance(feature, tfds.features.Image):
    return lambda v: v

  def png(v: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(v[..., 0] if v.ndim == 3 and v.shape[-1] == 1 else v).save(buffer, format="PNG")
    return buffer.getvalue()

  return png


def build_from_arrays(name: str, splits: Mapping[str, Mapping[str, np.ndarray]], data_dir: str, *,
                      version: str = "1.0.0", features: Mapping[str, Any] | None = None,
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
      `tfds.features.Image` arrays are PNG-encoded with PIL.

  Returns:
    The folder holding the prepared dataset.
  """
  import tensorflow_datasets as tfds

  _parse(f"{name}:{version}")
  if not splits:
    raise ValueError(f"build_from_arrays({name!r}): give at least one split, e.g. {{'train': arrays}}.")
  first = next(iter(splits.values()))
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
