"""Published per-chip figures of the TPU generations, and the names libtpu knows their slices by.

Sources (Cloud TPU documentation, "System architecture" tables, checked 2026-12-01):
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e. HBM capacity, HBM bandwidth,
bidirectional ICI bandwidth per chip and peak dense bf16 compute per chip as published (v4: no ICI
figure per chip); DCN per
chip is the host's NIC bandwidth over its chips where the page gives only the host's (v5e: 2 x 100
Gbps per 8-chip host), and unknown (None) where it gives neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoker.tpu import ACCELERATORS, TopologyError, slice_shape

GIB = 2**30


@dataclass(frozen=True)
class Chip:
    generation: str  # libtpu's topology prefix: v4, v5e, v5p, v6e
    hbm_bytes: int
    peak_bf16_flops: float  # dense, per second
    hbm_bytes_per_second: float
    ici_bytes_per_second: float | None  # bidirectional, per chip; None where not published
    dcn_bytes_per_second: float | None  # per chip; None where not published


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1200e9, None, None),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 400e9, 2 * 100e9 / 8 / 8),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 1200e9, 50e9 / 8),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1638e9, 800e9, None),
}


def chip(generation: str) -> Chip:
    try:
        return CHIPS[generation]
    except KeyError:
        raise TopologyError(
            f"no published figures for TPU {generation}; expected one of {', '.join(CHIPS)}"
        ) from None


def topology_name(accelerator: str, topology: str | None) -> str:
    """libtpu's name of a GKE slice: ``tpu-v5-lite-podslice`` + ``2x2`` -> ``v5e:2x2``."""
    slice_shape(accelerator, topology)  # TopologyError for a slice GKE cannot provision
    return f"{ACCELERATORS[accelerator].generation}:{topology}"


def parse_topology(name: str) -> tuple[str, str]:
    """``v5e:2x2`` -> (``v5e``, ``2x2``), or the GKE spelling ``tpu-v5-lite-podslice:2x2``."""
    generation, sep, shape = name.partition(":")
    if not sep or not shape:
        raise TopologyError(f"--topology {name!r}: expected GENERATION:SHAPE, e.g. v5e:2x2 or v5p:4x4x4")
    for accelerator, info in ACCELERATORS.items():
        if generation in (accelerator, info.generation):
            slice_shape(accelerator, shape)
            chip(info.generation)
            return info.generation, shape
    raise TopologyError(f"--topology {name!r}: unknown generation {generation!r}; expected one of {', '.join(CHIPS)}")
