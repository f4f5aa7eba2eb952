"""The device mesh and how parameters, optimizer state and batches are laid out on it.

Two named axes from ``learner.mesh``: ``fsdp`` (data parallel with parameters and optimizer state
sharded across it, ZeRO-3 style) and ``tp`` (tensor parallel). Batches split their rows over
``fsdp``. Every parameter gets a ``PartitionSpec`` from its shape alone (``param_spec``), so the same
rule lays out Adam's moments, which mirror the parameters; XLA's SPMD partitioner inserts the
all-gathers and reduce-scatters the layout implies, so any layout is correct and this rule only
decides the memory split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FSDP = "fsdp"
TP = "tp"
# Parameters smaller than this stay replicated: sharding them buys no memory and costs collectives.
MIN_SHARDED_SIZE = 2**14


def mesh_shape(num_devices: int, fsdp: int, tp: int) -> tuple[int, int]:
    """Resolve the spec's axis sizes (-1 = all remaining devices) against the device count."""
    if tp < 1 or num_devices % tp:
        raise ValueError(f"learner.mesh.tp={tp} does not divide the {num_devices} devices")
    if fsdp == -1:
        fsdp = num_devices // tp
    if fsdp < 1 or fsdp * tp != num_devices:
        raise ValueError(f"learner.mesh fsdp={fsdp} x tp={tp} = {fsdp * tp}; expected the {num_devices} devices")
    return fsdp, tp


def make_mesh(fsdp: int = -1, tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(fsdp, tp)`` mesh over ``devices`` (all devices when None); tp is the fastest-varying
    axis, so tensor-parallel peers are neighbours (same host / ICI ring)."""
    devs = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(len(devs), fsdp, tp)
    return Mesh(np.asarray(devs).reshape(shape), (FSDP, TP))


def param_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of one parameter (or optimizer moment) from its shape.

    Matrices: ``tp`` on the last dimension it divides (output features / vocabulary), ``fsdp`` on the
    largest other dimension it divides. Vectors and small arrays stay replicated.
    """
    axes: list[str | None] = [None] * len(shape)
    if len(shape) < 2 or int(np.prod(shape)) < MIN_SHARDED_SIZE:
        return PartitionSpec(*axes)
    tp, fsdp = mesh.shape[TP], mesh.shape[FSDP]
    if tp > 1:
        for dim in reversed(range(len(shape))):
            if shape[dim] % tp == 0:
                axes[dim] = TP
                break
    if fsdp > 1:
        candidates = [d for d in range(len(shape)) if axes[d] is None and shape[d] % fsdp == 0]
        if candidates:
            axes[max(candidates, key=lambda d: shape[d])] = FSDP
    return PartitionSpec(*axes)


def param_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """Where a parameter of this shape lives (``param_spec``), for loading or initialising it in place."""
    return NamedSharding(mesh, param_spec(shape, mesh))


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array leaf of ``tree`` (params, optimizer state)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(np.shape(x), mesh)), tree)


def stacked_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """A [layers, ...] stack of per-layer parameters: each layer laid out as ``param_spec`` lays it
    out alone, the layer axis unsplit (the layer loop reads one layer at a time)."""
    return NamedSharding(mesh, PartitionSpec(None, *param_spec(shape[1:], mesh)))


def residual_sharding(mesh: Mesh) -> NamedSharding:
    """The residual stream [rows, T, hidden] between layers with sequence sharding: rows over
    fsdp, tokens over tp (each layer's saved input is 1/tp per device)."""
    return NamedSharding(mesh, PartitionSpec(FSDP, TP, None))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[rows, T] batch arrays: rows split over fsdp, replicated over tp."""
    return NamedSharding(mesh, PartitionSpec(FSDP, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return int(mesh.shape[FSDP])
