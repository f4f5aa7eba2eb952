"""What every section of the RLJob spec shares: the base model, Kubernetes name and quantity
patterns, the TPU accelerators and topologies, and container resources.

Import the spec from ``stoker.spec``; this module only keeps each shared type in one place.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# A Kubernetes resource quantity such as "500m", "2", "4Gi".
QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
# RFC 1123 DNS label: what Kubernetes accepts as an object name used in child names.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# RFC 1123 subdomain: ServiceAccount names.
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

# GKE's TPU accelerator labels (stoker.tpu has each one's slice shapes), and a slice topology.
TpuAccelerator = Literal["tpu-v4-podslice", "tpu-v5-lite-podslice", "tpu-v5p-slice", "tpu-v6e-slice", "tpu7x"]
TPU_ACCELERATORS: tuple[str, ...] = get_args(TpuAccelerator)
TpuTopology = Annotated[str, Field(pattern=r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$", max_length=20)]


class SpecModel(BaseModel):
    """Base for every part of the spec: camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=True,
    )


class ResourceList(SpecModel):
    cpu: Annotated[str, Field(pattern=QUANTITY_PATTERN)] | None = None
    memory: Annotated[str, Field(pattern=QUANTITY_PATTERN)] | None = None


class Resources(SpecModel):
    requests: ResourceList = Field(default_factory=ResourceList)
    limits: ResourceList = Field(default_factory=ResourceList)
