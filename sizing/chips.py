"""The names libtpu knows TPU slices by, over the chips' published figures (``stoker.tpu_figures``)."""

from __future__ import annotations

from stoker.tpu import ACCELERATORS, TopologyError, slice_shape
from stoker.tpu_figures import CHIPS, GIB, Chip, chip_of_device  # noqa: F401 (re-exported: the sizing tools' names)


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
