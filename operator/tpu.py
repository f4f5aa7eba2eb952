"""GKE TPU slice shapes live in ``stoker.tpu``: the spec validates topologies with them too."""

from stoker.tpu import (
    ACCELERATOR_LABEL,
    ACCELERATORS,
    NODEPOOL_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    SliceShape,
    TopologyError,
    slice_shape,
)

__all__ = [
    "ACCELERATOR_LABEL",
    "ACCELERATORS",
    "NODEPOOL_LABEL",
    "TOPOLOGY_LABEL",
    "TPU_RESOURCE",
    "SliceShape",
    "TopologyError",
    "slice_shape",
]
