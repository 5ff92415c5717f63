"""Accelerator specs for the roofline model: peak FLOP/s, HBM bandwidth, memory, price.

Real parts use the vendors' published dense BF16 figures (no sparsity):

- H100 SXM5: 989 TFLOP/s, 3.35 TB/s HBM3, 80 GB. NVIDIA H100 Tensor Core GPU datasheet
  (nvidia.com/en-us/data-center/h100, "H100 SXM" column).
- H200 SXM: 989 TFLOP/s, 4.8 TB/s HBM3e, 141 GB. NVIDIA H200 datasheet
  (nvidia.com/en-us/data-center/h200).
- A100 80GB SXM: 312 TFLOP/s, 2.039 TB/s HBM2e, 80 GB. NVIDIA A100 datasheet
  (nvidia.com/en-us/data-center/a100).
- L40S: 362 TFLOP/s (733 with sparsity), 864 GB/s GDDR6, 48 GB. NVIDIA L40S datasheet
  (nvidia.com/en-us/data-center/l40s).
- TPU v5e: 197 TFLOP/s BF16, 819 GB/s HBM2, 16 GB per chip. Google Cloud TPU v5e docs
  (cloud.google.com/tpu/docs/v5e).

Prices are illustrative on-demand USD per chip-hour of the order seen on public cloud price
lists in 2024-2025 (TPU v5e: Google Cloud list price, $1.20); they vary by provider and
commitment, and every planner figure scales with them, so pass your own where it matters.

GPU-A and GPU-B are the report's abstract pair, which it names only by role: A is
prefill-strong, B decode-strong and priced 20-30% above A. We make the asymmetry explicit and
symmetric: A has twice B's FLOP/s, B has twice A's HBM bandwidth and 1.5x its memory, and B
costs 1.25x A (the middle of the report's 20-30%). A's compute is in the H100 class, B's
memory system in the H20 / H200 class. These are assumptions, not the report's chips.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TERA = 1e12
GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    """One chip: what the roofline needs."""

    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bw: float  # bytes/s
    mem_bytes: float  # device memory, bytes
    price_per_hour: float  # USD per chip-hour (illustrative)
    source: str = ""

    def with_price(self, price_per_hour: float) -> Accelerator:
        return dataclasses.replace(self, price_per_hour=price_per_hour)


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator("h100", 989 * TERA, 3.35 * TERA, 80 * GB, 3.00, "NVIDIA H100 SXM datasheet"),
    "h200": Accelerator("h200", 989 * TERA, 4.8 * TERA, 141 * GB, 3.80, "NVIDIA H200 SXM datasheet"),
    "a100": Accelerator("a100", 312 * TERA, 2.039 * TERA, 80 * GB, 1.80, "NVIDIA A100 80GB SXM datasheet"),
    "l40s": Accelerator("l40s", 362 * TERA, 0.864 * TERA, 48 * GB, 1.00, "NVIDIA L40S datasheet"),
    "tpu-v5e": Accelerator("tpu-v5e", 197 * TERA, 0.819 * TERA, 16 * GB, 1.20, "Google Cloud TPU v5e docs"),
    "gpu-a": Accelerator("gpu-a", 800 * TERA, 2.0 * TERA, 64 * GB, 2.00, "abstract prefill-strong (PDD report)"),
    "gpu-b": Accelerator("gpu-b", 400 * TERA, 4.0 * TERA, 96 * GB, 2.50, "abstract decode-strong, 1.25x price"),
}


def get_accelerator(name: str) -> Accelerator:
    """Look up a preset by name (case-insensitive); KeyError names the choices."""
    key = name.lower()
    if key not in ACCELERATORS:
        raise KeyError(f"unknown accelerator {name!r}; choose from {', '.join(ACCELERATORS)}")
    return ACCELERATORS[key]
