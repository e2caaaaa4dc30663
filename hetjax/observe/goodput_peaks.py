"""Vendor peak FLOP/s of a few accelerators, to say what fraction of its peak a host achieved.

Dense datasheet figures per device, in FLOP/s, shown as "vendor figure" with
their source; a device kind not listed (every CPU) says "peak unknown". `fp32`:
the non-tensor-core peak (XLA's TF32 matmuls on A100 and newer can exceed it);
`bf16`: the dense tensor-core peak, for bf16 and fp16 (V100: its fp16 peak).
"""

from __future__ import annotations

import dataclasses

TERA = 1e12


@dataclasses.dataclass(frozen=True)
class Peak:
  """One device's vendor peak for one precision."""

  flops_per_s: float
  device: str     # the table's name for the device
  source: str     # the datasheet the figure comes from
  index: int = -1  # its row in the table (a number that crosses hosts in a float vector)


# (substring of jax's device_kind, lower case) -> (name, bf16 dense, fp32, source).
# Ordered: the first match wins, so the more specific names come first.
_TABLE = (
    ("h100 pcie", "H100 PCIe", 756.0, 51.2, "NVIDIA H100 Tensor Core GPU datasheet"),
    ("h100", "H100 SXM", 989.4, 66.9, "NVIDIA H100 Tensor Core GPU datasheet"),
    ("h200", "H200 SXM", 989.4, 66.9, "NVIDIA H200 Tensor Core GPU datasheet"),
    ("a100", "A100", 312.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet"),
    ("v100", "V100 SXM2", 125.0, 15.7, "NVIDIA V100 Tensor Core GPU datasheet (fp16)"),
    ("l4", "L4", 121.0, 30.3, "NVIDIA L4 Tensor Core GPU datasheet"),
    ("t4", "T4", 65.0, 8.1, "NVIDIA T4 Tensor Core GPU datasheet (fp16)"),
)


def peak(device_kind: str | None, precision: str = "fp32") -> Peak | None:
  """The vendor peak of one device of `device_kind` at `precision`; None where unknown (CPUs)."""
  kind = (device_kind or "").lower()
  for index, (pattern, name, half, single, source) in enumerate(_TABLE):
    if pattern in kind:
      figure = single if precision == "fp32" else half
      return Peak(figure * TERA, name, source, index)
  return None


def row(index: int) -> tuple[str, str] | None:
  """(device name, source) of table row `index`; None for -1 (unknown)."""
  return None if index < 0 else (_TABLE[index][1], _TABLE[index][4])
