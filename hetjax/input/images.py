"""Image recipes as the field uses them, keyed by the example, uint8 out.

As the Flax ImageNet example and big_vision: training decodes, crops Inception-style (area
8-100 %, aspect 3/4-4/3) to `size x size` and flips; evaluation resizes the shorter side to
`size / 0.875` and centre-crops.

Every draw hashes the example's key (`augment.example_keys`), so a record is cropped and
flipped alike on any host and split (invariant 1). Pixels stay uint8 (a quarter of float32's
bytes to the device); the models scale them there (`zoo.preprocess`).

JPEGs: simplejpeg (libjpeg-turbo, accurate IDCT) at the smallest DCT scale (1/2, 1/4, 1/8)
leaving the crop >= `size` pixels (a fraction of a full decode), then OpenCV bilinear, as DALI
and FFCV do (docs/data.md: what that changes in pixels). Other formats and CMYK: PIL.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Callable

import numpy as np

from hetjax.input import shuffle
from hetjax.input.sources import Batch, DatasetInfo, Source

EVAL_CROP_FRACTION = 0.875  # Resize to size / 0.875, keep the central size x size.
CROP_AREA = (0.08, 1.0)  # Inception / torchvision RandomResizedCrop defaults.
CROP_RATIO = (3 / 4, 4 / 3)
_ATTEMPTS = 10
_CROP_STREAM, _FLIP_STREAM = np.uint64(0x1C409), np.uint64(0x1F119)
_MODES = {1: "L", 3: "RGB"}
Box = tuple[float, float, float, float]  # (left, top, right, bottom) in pixels.


@dataclasses.dataclass(frozen=True)
class ImageRecipe:
  """How training sees an image; evaluation always resizes and centre-crops.

  Attributes:
    size: the side of the square output, in pixels.
    channels: 1 (grey) or 3 (RGB); decoded images are converted to it.
    crop: random resized crop in training (else the evaluation crop).
    flip: random left-right flip in training.
  """

  size: int
  channels: int = 3
  crop: bool = False
  flip: bool = False

  def __post_init__(self):
    if not 1 <= self.size <= 4096:
      raise ValueError(f"image size must be in [1, 4096] pixels, got {self.size}; pass e.g. "
                       "--image-size 224.")
    if self.channels not in _MODES:
      raise ValueError(f"images must have 1 or 3 channels, got {self.channels}.")


def recipe_from_augment(size: int, channels: int, spec: str | None) -> ImageRecipe:
  """`--augment` ('none', 'crop', 'flip', 'crop,flip') for decoded images."""
  names = set() if spec is None or spec.strip() in ("", "none") else {
      t.strip() for t in spec.split(",")}
  unknown = sorted(names - {"crop", "flip"})
  if unknown:
    raise ValueError(f"augmentation {spec!r} for decoded images: only crop (random resized "
                     f"crop) and flip apply, not {', '.join(unknown)}; e.g. --augment crop,flip.")
  return ImageRecipe(size, channels, crop="crop" in names, flip="flip" in names)


def _uniform(keys: np.ndarray, stream: np.uint64, count: int) -> np.ndarray:
  """`[len(keys), count]` floats in [0, 1), a hash of (key, stream, draw)."""
  counters = np.asarray(keys, np.uint64)[:, None] ^ (stream + np.arange(count, dtype=np.uint64))
  return (shuffle.mix64(shuffle.mix64(counters)) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def random_crop_box(width: int, height: int, draws: np.ndarray) -> Box:
  """An Inception crop `(left, top, right, bottom)` from `_ATTEMPTS x 4` uniform draws, as
  torchvision's RandomResizedCrop: up to ten tries at an area and aspect ratio that fit; then
  the largest central crop of a clamped ratio."""
  area = width * height
  lo, hi = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
  for u_area, u_ratio, u_x, u_y in draws.reshape(_ATTEMPTS, 4):
    target = area * (CROP_AREA[0] + u_area * (CROP_AREA[1] - CROP_AREA[0]))
    ratio = math.exp(lo + u_ratio * (hi - lo))
    w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
    if 0 < w <= width and 0 < h <= height:
      x, y = math.floor(u_x * (width - w + 1)), math.floor(u_y * (height - h + 1))
      return x, y, x + w, y + h
  ratio = width / height
  if ratio < CROP_RATIO[0]:
    w, h = width, round(width / CROP_RATIO[0])
  elif ratio > CROP_RATIO[1]:
    w, h = round(height * CROP_RATIO[1]), height
  else:
    w, h = width, height
  x, y = (width - w) // 2, (height - h) // 2
  return x, y, x + w, y + h


def centre_crop_box(width: int, height: int) -> Box:
  """The central square the evaluation keeps, `EVAL_CROP_FRACTION` of the shorter side."""
  side = EVAL_CROP_FRACTION * min(width, height)
  x, y = (width - side) / 2, (height - side) / 2
  return x, y, x + side, y + side


def _scaled_box(box: Box, sx: float, sy: float) -> Box:
  return box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy


def _dct_factor(width: int, height: int, box: Box, size: int) -> int:
  """The largest of 1, 2, 4, 8 whose DCT-reduced image still holds the box at >= `size` pixels
  (the resize then shrinks < 2x, where bilinear without antialiasing loses little)."""
  want_w = width * size / max(box[2] - box[0], 1e-9)
  want_h = height * size / max(box[3] - box[1], 1e-9)
  factor = 1
  while factor < 8 and -(-width // (2 * factor)) >= want_w and -(-height // (2 * factor)) >= want_h:
    factor *= 2
  return factor


def _decode_jpeg(data: bytes, size: int, channels: int, box_fn: Callable[[int, int], Box]
                 ) -> np.ndarray | None:
  """libjpeg-turbo (simplejpeg) at a DCT scale, crop, OpenCV bilinear resize; None: not for this path."""
  import cv2
  import simplejpeg
  cv2.setNumThreads(1)  # The loader's worker processes are the parallelism; more would oversubscribe.
  try:
    height, width, colour, _ = simplejpeg.decode_jpeg_header(data)
  except ValueError:
    return None  # Not a JPEG: PIL reads it.
  if colour in ("CMYK", "YCCK"):
    return None  # CMYK / YCCK (a few ImageNet photos): PIL converts them.
  box = box_fn(width, height)
  factor = _dct_factor(width, height, box, size)
  space = "GRAY" if channels == 1 else "RGB"
  if factor == 1:
    image = simplejpeg.decode_jpeg(data, space)
  else:  # min_factor pins the power of two: libjpeg-turbo's M/8 scales are slower and off PIL's.
    image = simplejpeg.decode_jpeg(data, space, min_height=-(-height // factor),
                                   min_width=-(-width // factor), min_factor=factor)
    box = _scaled_box(box, image.shape[1] / width, image.shape[0] / height)
  left, top, right, bottom = (int(round(v)) for v in box)
  crop = image[top:max(bottom, top + 1), left:max(right, left + 1)]
  return cv2.resize(crop, (size, size), interpolation=cv2.INTER_LINEAR).reshape(size, size, channels)


def decode_crop(data: bytes, size: int, channels: int, box_fn: Callable[[int, int], Box],
                flip: bool) -> np.ndarray:
  """Decodes `data` and resizes `box_fn(width, height)` to uint8 `[size, size, channels]`:
  JPEGs by the field's fast path (`_decode_jpeg`), other formats by PIL."""
  pixels = _decode_jpeg(data, size, channels, box_fn)
  if pixels is None:
    pixels = _decode_pil(data, size, channels, box_fn)
  return pixels[:, ::-1] if flip else pixels


def _decode_pil(data: bytes, size: int, channels: int, box_fn: Callable[[int, int], Box]
                ) -> np.ndarray:
  from PIL import Image

  image = Image.open(io.BytesIO(data))
  width, height = image.size
  box = box_fn(width, height)
  factor = _dct_factor(width, height, box, size) if image.format == "JPEG" else 1
  if factor > 1:  # CMYK JPEGs: PIL's DCT scaling (`draft`).
    image.draft(_MODES[channels], (-(-width // factor), -(-height // factor)))
    box = _scaled_box(box, image.size[0] / width, image.size[1] / height)
  out = image.convert(_MODES[channels]).resize((size, size), Image.BILINEAR, box=box)
  pixels = np.asarray(out, dtype=np.uint8)
  return pixels[..., None] if pixels.ndim == 2 else pixels


class ImageSource:
  """Encoded images as fixed-size uint8 records: evaluation and training views.

  `source[indices]`: evaluation view; `train_records(indices, keys)`: training view. Both give
  `{"x": uint8 [n, size, size, channels], "y": int32 [n]}`.
  """

  def __init__(self, encoded: Source, recipe: ImageRecipe, *, info: DatasetInfo | None = None):
    """`encoded`: records `{"image": object array of encoded bytes, "label": ints}`; `recipe`:
    the output size, channels and training randomness; `info` default `encoded.info`."""
    self.encoded, self.recipe = encoded, recipe
    self.info = info or encoded.info

  def __len__(self) -> int:
    return len(self.encoded)

  def __getitem__(self, indices: np.ndarray) -> Batch:
    return self._decode(indices, None)

  def train_records(self, indices: np.ndarray, keys: np.ndarray) -> Batch:
    """The records at `indices` as training sees them; `keys` from `augment.example_keys`."""
    return self._decode(indices, np.asarray(keys, np.uint64).reshape(-1))

  def _decode(self, indices: np.ndarray, keys: np.ndarray | None) -> Batch:
    r = self.recipe
    indices = np.asarray(indices, np.int64).reshape(-1)
    records = self.encoded[indices]
    blobs, n = records["image"], len(records["label"])
    crops = _uniform(keys, _CROP_STREAM, 4 * _ATTEMPTS) if keys is not None and r.crop else None
    flips = (_uniform(keys, _FLIP_STREAM, 1)[:, 0] < 0.5) if keys is not None and r.flip else None
    x = np.empty((n, r.size, r.size, r.channels), np.uint8)
    for i in range(n):
      box_fn = centre_crop_box if crops is None else (
          lambda w, h, d=crops[i]: random_crop_box(w, h, d))
      try:
        x[i] = decode_crop(bytes(blobs[i]), r.size, r.channels, box_fn,
                           flip=bool(flips[i]) if flips is not None else False)
      except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError.
        raise ValueError(f"dataset {self.info.name!r}: record {indices[i]} is not a readable "
                         f"image ({e}); rebuild the dataset or drop that record.") from e
    return {"x": x, "y": np.asarray(records["label"], np.int32)}
