"""Published per-chip figures of the TPU generations: the sizing tools' bounds and the MFU a run reports.

Sources (Cloud TPU documentation, "System architecture" tables, checked 2026-12-01):
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e. HBM capacity, HBM bandwidth,
bidirectional ICI bandwidth per chip and peak dense bf16 compute per chip as published (v4: no ICI
figure per chip); DCN per chip is the host's NIC bandwidth over its chips where the page gives only
the host's (v5e: 2 x 100 Gbps per 8-chip host), and unknown (None) where it gives neither.

``usable_hbm_bytes`` is what libtpu 0.0.42 lets one program hold, measured here: an over-sized
program's refusal names the "available HBM" (v5e 15.75G, v5p 95.74G, v6e 31.25G, v4 15.25G per
TensorCore, two per chip). Plans are judged against it, not the published capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Chip:
    generation: str  # libtpu's topology prefix: v4, v5e, v5p, v6e
    hbm_bytes: int
    peak_bf16_flops: float  # dense, per second
    hbm_bytes_per_second: float
    ici_bytes_per_second: float | None  # bidirectional, per chip; None where not published
    dcn_bytes_per_second: float | None  # per chip; None where not published
    usable_hbm_bytes: int  # what the compiler lets a program use (module doc)


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1200e9, None, None, int(2 * 15.25 * GIB)),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 400e9, 2 * 100e9 / 8 / 8, int(15.75 * GIB)),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 1200e9, 50e9 / 8, int(95.74 * GIB)),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1638e9, 800e9, None, int(31.25 * GIB)),
}


# JAX's ``device_kind`` of each generation's chips (one JAX device per chip: v4 and v5p megacore).
DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def chip_of_device(device_kind: str) -> Chip | None:
    """The published figures of a device of this kind; None for one without (the CPU, a GPU)."""
    generation = DEVICE_KINDS.get(device_kind)
    return CHIPS[generation] if generation else None
