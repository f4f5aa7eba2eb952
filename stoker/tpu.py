"""GKE TPU slice shapes: accelerator + topology -> chips, hosts and chips per host.

A slice of ``chips`` chips with ``chips_per_host`` chips on each TPU VM runs one learner pod per
VM, so a slice is ``hosts = chips / chips_per_host`` pods, each asking for ``google.com/tpu:
chips_per_host``. The rules follow GKE's "Plan TPUs" tables:

* v4 (``tpu-v4-podslice``), v5p (``tpu-v5p-slice``) and Ironwood (``tpu7x``): 3-D topologies
  ``AxBxC``, 4 chips per VM; the small shapes 2x2x1, 2x2x2, 2x2x4 and 2x4x4, otherwise every side a
  multiple of 4.
* v5e (``tpu-v5-lite-podslice``) and v6e (``tpu-v6e-slice``): 2-D topologies from a fixed list;
  single-host slices (<= 8 chips) put all chips on one VM (1, 4 or 8), larger slices 4 per VM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"


class TopologyError(ValueError):
    """A topology that GKE cannot provision for the accelerator; the message says what would work."""


@dataclass(frozen=True)
class SliceShape:
    """One TPU slice as Kubernetes sees it."""

    chips: int
    hosts: int
    chips_per_host: int

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1


@dataclass(frozen=True)
class AcceleratorInfo:
    generation: str
    dims: int
    max_chips: int
    # 2-D generations: the accepted topologies; 3-D generations use the multiple-of-4 rule.
    topologies: tuple[str, ...] = ()


SMALL_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
V5E_V6E = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

ACCELERATORS: dict[str, AcceleratorInfo] = {
    "tpu-v4-podslice": AcceleratorInfo("v4", dims=3, max_chips=4096),
    "tpu-v5p-slice": AcceleratorInfo("v5p", dims=3, max_chips=8960),
    "tpu7x": AcceleratorInfo("tpu7x", dims=3, max_chips=9216),
    "tpu-v5-lite-podslice": AcceleratorInfo("v5e", dims=2, max_chips=256, topologies=V5E_V6E),
    "tpu-v6e-slice": AcceleratorInfo("v6e", dims=2, max_chips=256, topologies=V5E_V6E),
}

# Chips on one TPU VM: 3-D generations always 4; 2-D ones a single VM up to 8 chips, else 4.
CHIPS_PER_HOST_3D = 4
SINGLE_HOST_MAX_CHIPS_2D = 8
CHIPS_PER_HOST_2D_MULTI = 4


def _parse(topology: str) -> tuple[int, ...]:
    try:
        sides = tuple(int(part) for part in topology.split("x"))
    except ValueError:
        raise TopologyError(f"topology {topology!r} is not of the form AxB or AxBxC") from None
    if not sides or any(side < 1 for side in sides):
        raise TopologyError(f"topology {topology!r} has a side < 1")
    return sides


def slice_shape(accelerator: str, topology: str | None) -> SliceShape:
    """The slice a (accelerator, topology) pair describes, or ``TopologyError`` saying why not."""
    info = ACCELERATORS.get(accelerator)
    if info is None:
        raise TopologyError(f"accelerator {accelerator!r} is not a TPU; expected one of {sorted(ACCELERATORS)}")
    if topology is None:
        raise TopologyError(f"accelerator {accelerator} needs learner.topology")
    sides = _parse(topology)
    if len(sides) != info.dims:
        example = "2x2x1" if info.dims == 3 else "2x4"
        raise TopologyError(
            f"topology {topology} has {len(sides)} dimensions; TPU {info.generation} ({accelerator}) "
            f"uses {info.dims}-D topologies such as {example}"
        )
    chips = math.prod(sides)
    if info.dims == 3:
        if topology not in SMALL_3D and any(side % 4 for side in sides):
            raise TopologyError(
                f"topology {topology} is not a TPU {info.generation} slice: expected one of "
                f"{', '.join(SMALL_3D)} or sides that are all multiples of 4 (e.g. 4x4x8)"
            )
        if chips > info.max_chips:
            raise TopologyError(
                f"topology {topology} has {chips} chips; TPU {info.generation} slices hold at most {info.max_chips}"
            )
        per_host = CHIPS_PER_HOST_3D
    else:
        if topology not in info.topologies:
            raise TopologyError(
                f"topology {topology} is not a TPU {info.generation} slice: expected one of {', '.join(info.topologies)}"
            )
        per_host = chips if chips <= SINGLE_HOST_MAX_CHIPS_2D else CHIPS_PER_HOST_2D_MULTI
    return SliceShape(chips=chips, hosts=chips // per_host, chips_per_host=per_host)


def hosts_per_slice(accelerator: str, topology: str | None) -> int:
    """Learner pods per slice: 1 on the CPU; raises ``TopologyError`` for an impossible topology."""
    if accelerator == "cpu":
        return 1
    return slice_shape(accelerator, topology).hosts
