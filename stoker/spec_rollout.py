"""The rollout tier's section of the RLJob spec (``spec.rollout``), its cross-field rules and
their CEL twins.

Import the spec from ``stoker.spec``; ``stoker.spec_rules`` gathers these rules with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from stoker import spec_cel
from stoker.spec_base import DNS_LABEL_PATTERN, TPU_ACCELERATORS, ResourceList, Resources, SpecModel, TpuAccelerator, TpuTopology
from stoker.spec_cel import cel
from stoker.tpu import TopologyError, hosts_per_slice, slice_shape

if TYPE_CHECKING:  # for annotations only: stoker.spec imports this module
    from stoker.spec import RLJobSpec


class RolloutSpec(SpecModel):
    """The rollout tier: generation servers on accelerators that the actors call (``stoker rollout``).

    Without it (the default) every actor samples in-process on its own CPU, which suits small
    policies; with it the actors keep episodes and sandboxes and send token ids to these servers.
    """

    replicas: int = Field(1, ge=0, description="Rollout servers (each a Deployment pod, or a group of hosts on a multi-host TPU slice).")
    min_replicas: int = Field(1, ge=0, description="Autoscaling floor.")
    max_replicas: int = Field(4, ge=1, description="Autoscaling ceiling.")
    accelerator: Literal["cpu", "nvidia-gpu", TpuAccelerator] = Field(
        "cpu", description="cpu, nvidia-gpu, or a GKE TPU accelerator label."
    )
    topology: TpuTopology | None = Field(None, description="TPU topology of each server's slice, e.g. 2x2.")
    gpus: int = Field(1, ge=1, le=16, description="GPUs per server (accelerator nvidia-gpu): the nvidia.com/gpu limit.")
    gpu_type: Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=63)] | None = Field(
        None, description="GKE GPU node label cloud.google.com/gke-accelerator, e.g. nvidia-l4 (nvidia-gpu only)."
    )
    tensor_parallel: int | None = Field(
        None,
        ge=1,
        description=(
            "Chips each server splits the model over (tensor parallelism: each chip holds 1/tensorParallel "
            "of every large matrix). At most the server's chips: gpus (nvidia-gpu), the chips of its TPU "
            "slice (all its hosts); any on cpu (a local run forces host devices). Unset: all the server's "
            "chips, or the most of them that divides the model's attention heads; 1 on cpu."
        ),
    )
    image: str | None = Field(None, description="Rollout image; the learner image when unset (it has the accelerator runtime).")
    resources: Resources = Field(
        default_factory=lambda: Resources(
            requests=ResourceList(cpu="2", memory="8Gi"), limits=ResourceList(cpu="4", memory="16Gi")
        )
    )
    max_batch: int = Field(32, ge=1, le=4096, description="Sequences each server decodes together.")
    max_queue: int = Field(
        256,
        ge=1,
        description="Requests waiting beyond the batch after which a server answers RESOURCE_EXHAUSTED with a retry hint.",
    )
    port: int = Field(50053, ge=1, le=65535)


def rollout_problems(spec: RLJobSpec) -> list[tuple[str, str]]:
    """``spec.rollout``'s rules: the accelerator's own fields only, a slice GKE has, sane bounds,
    no more tensor-parallel chips than a server has.

    A colocated job refuses a rollout tier: its learner generates on its own mesh, so servers
    beside it would never be called (docs/operator.md, "The rollout tier")."""
    rollout = spec.rollout
    if rollout is None:
        return []
    problems: list[tuple[str, str]] = []
    if spec.mode == "colocated":
        problems.append(
            ("rollout", "set in colocated mode; expected unset (a colocated learner generates on its own mesh)")
        )
    if rollout.min_replicas > rollout.max_replicas:
        problems.append(
            ("rollout.minReplicas", f"got {rollout.min_replicas}; expected <= maxReplicas ({rollout.max_replicas})")
        )
    accelerator = rollout.accelerator
    if accelerator in TPU_ACCELERATORS:
        if rollout.topology is None:
            problems.append(("rollout.topology", f"missing; required for accelerator {accelerator}"))
        else:
            try:
                hosts_per_slice(accelerator, rollout.topology)
            except TopologyError as exc:
                problems.append(("rollout.topology", str(exc)))
    elif rollout.topology is not None:
        problems.append(("rollout.topology", f"got {rollout.topology}; expected unset for accelerator {accelerator} (TPU only)"))
    if accelerator != "nvidia-gpu":
        if rollout.gpus != 1:
            problems.append(("rollout.gpus", f"got {rollout.gpus}; expected unset for accelerator {accelerator} (nvidia-gpu only)"))
        if rollout.gpu_type is not None:
            problems.append(("rollout.gpuType", f"got {rollout.gpu_type}; expected unset for accelerator {accelerator} (nvidia-gpu only)"))
    chips = rollout_chips(rollout)
    if rollout.tensor_parallel is not None and chips is not None and rollout.tensor_parallel > chips:
        server = f"gpus ({chips})" if accelerator == "nvidia-gpu" else f"the {chips} chips of a {accelerator} {rollout.topology} slice"
        problems.append(("rollout.tensorParallel", f"got {rollout.tensor_parallel}; expected <= {server}"))
    return problems


def rollout_chips(rollout: RolloutSpec) -> int | None:
    """Chips per rollout server as the spec gives them: ``gpus``, or every chip of the TPU slice
    (hosts x chips per host); None on the CPU and for a bad topology (reported on its own)."""
    if rollout.accelerator == "nvidia-gpu":
        return rollout.gpus
    if rollout.accelerator not in TPU_ACCELERATORS:
        return None
    try:
        return slice_shape(rollout.accelerator, rollout.topology).chips
    except TopologyError:
        return None


def rollout_hosts(rollout: RolloutSpec) -> int:
    """Pods per rollout server: the hosts of its TPU slice, 1 otherwise (and for a bad topology,
    which is reported on its own)."""
    if rollout.accelerator not in TPU_ACCELERATORS:
        return 1
    try:
        return hosts_per_slice(rollout.accelerator, rollout.topology)
    except TopologyError:
        return 1


# CEL twins of rollout_problems, at spec.rollout (tests/core/test_cel.py runs both on one table).
_TPUS = spec_cel.string_list(TPU_ACCELERATORS)

ROLLOUT_CEL_RULES: list[dict[str, Any]] = [
    cel("self.minReplicas <= self.maxReplicas", "minReplicas must be <= maxReplicas"),
    cel(f"!(self.accelerator in {_TPUS}) || has(self.topology)", "topology is required for a TPU accelerator"),
    cel(
        f"!(self.accelerator in {_TPUS}) || !has(self.topology) || "
        + spec_cel.valid_topology("self.accelerator", "self.topology"),
        "topology is not one this accelerator has (stoker validate names the ones it has)",
    ),
    cel(f"self.accelerator in {_TPUS} || !has(self.topology)", "topology is for TPU accelerators only"),
    cel("self.accelerator == 'nvidia-gpu' || self.gpus == 1", "gpus is for accelerator nvidia-gpu only"),
    cel("self.accelerator == 'nvidia-gpu' || !has(self.gpuType)", "gpuType is for accelerator nvidia-gpu only"),
    # A topology the accelerator lacks is refused above; its chips here only add a second message.
    cel(
        "!has(self.tensorParallel) || self.accelerator == 'cpu' || (self.accelerator == 'nvidia-gpu' ? "
        f"self.tensorParallel <= self.gpus : !has(self.topology) || self.tensorParallel <= {spec_cel.chips('self.topology')})",
        "tensorParallel must not exceed the server's chips (gpus, or the chips of its TPU slice)",
    ),
]

# At the root, beside the learner's name rule (name_problems): a multi-host server's pod names.
_ROLLOUT = "self.spec.rollout"
_ROLLOUT_HOSTS = spec_cel.hosts(f"{_ROLLOUT}.accelerator", f"{_ROLLOUT}.topology")
_ROOT_HAS_MULTI_HOST_ROLLOUT = (
    f"has(self.spec) && has({_ROLLOUT}) && {_ROLLOUT}.accelerator in {_TPUS} && has({_ROLLOUT}.topology) && "
    + spec_cel.valid_topology(f"{_ROLLOUT}.accelerator", f"{_ROLLOUT}.topology")
    + f" && {_ROLLOUT_HOSTS} > 1"
)
ROLLOUT_NAME_CEL_RULE = cel(
    f"!has(self.metadata.name) || !({_ROOT_HAS_MULTI_HOST_ROLLOUT}) || "
    + spec_cel.rollout_name_fits("self.metadata.name", f"{_ROLLOUT}.maxReplicas", _ROLLOUT_HOSTS),
    "metadata.name is too long: the rollout pods' names (<name>-rollout-<server>-slice-0-<host>-<5 characters>) "
    "must stay at most 63 characters (stoker validate says the limit)",
)
