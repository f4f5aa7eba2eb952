"""The device mesh and how parameters, optimizer state and batches are laid out on it.

Three named axes from ``learner.mesh``: ``fsdp`` (data parallel with parameters and optimizer state
sharded across it, ZeRO-3 style), ``ep`` (expert parallel: a mixture of experts' experts split
over it; data parallel everywhere else) and ``tp`` (tensor parallel). Batches split their rows
over fsdp x ep. Every parameter gets a ``PartitionSpec`` from its shape alone (``param_spec``), so
the same rule lays out Adam's moments, which mirror the parameters; XLA's SPMD partitioner inserts
the all-gathers and reduce-scatters the layout implies, so any layout is correct and this rule
only decides the memory split. The experts' tokens travel by all-to-all (``expert_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stoker.model.expert_parallel import ExpertLayout

FSDP = "fsdp"
EP = "ep"
TP = "tp"
# Parameters smaller than this stay replicated: sharding them buys no memory and costs collectives.
MIN_SHARDED_SIZE = 2**14


def mesh_shape(num_devices: int, fsdp: int, tp: int, ep: int = 1) -> tuple[int, int, int]:
    """Resolve the spec's axis sizes (-1 = all remaining devices) against the device count:
    (fsdp, ep, tp)."""
    if tp < 1 or ep < 1 or num_devices % (tp * ep):
        axes = f"learner.mesh.tp={tp}" if ep == 1 else f"learner.mesh tp={tp} x ep={ep}"
        raise ValueError(f"{axes} does not divide the {num_devices} devices")
    if fsdp == -1:
        fsdp = num_devices // (tp * ep)
    if fsdp < 1 or fsdp * ep * tp != num_devices:
        raise ValueError(
            f"learner.mesh fsdp={fsdp} x ep={ep} x tp={tp} = {fsdp * ep * tp}; expected the {num_devices} devices"
        )
    return fsdp, ep, tp


def make_mesh(fsdp: int = -1, tp: int = 1, devices: Sequence[jax.Device] | None = None, ep: int = 1) -> Mesh:
    """A ``(fsdp, ep, tp)`` mesh over ``devices`` (all devices when None); tp is the fastest-varying
    axis, so tensor-parallel peers are neighbours (same host / ICI ring), then ep, whose
    all-to-alls are the next busiest."""
    devs = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(len(devs), fsdp, tp, ep)
    return Mesh(np.asarray(devs).reshape(shape), (FSDP, EP, TP))


def row_axes(mesh: Mesh) -> str | tuple[str, str]:
    """The axes batch rows split over, as a PartitionSpec entry: fsdp, and ep when it is used."""
    return (FSDP, EP) if mesh.shape[EP] > 1 else FSDP


def param_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec of one parameter (or optimizer moment) from its shape.

    Matrices: ``tp`` on the last dimension it divides (output features / vocabulary), the data
    axes (fsdp, with ep when it divides too) on the largest other dimension they divide. A 3-D
    parameter is a stack of experts [E, hidden, width] (``stoker.model.moe``): with ep > 1, E over
    ep, the width over tp and the hidden size over fsdp, as ``expert_layout`` computes them.
    Vectors and small arrays stay replicated.
    """
    axes: list[str | tuple[str, str] | None] = [None] * len(shape)
    if len(shape) < 2 or int(np.prod(shape)) < MIN_SHARDED_SIZE:
        return PartitionSpec(*axes)
    tp, fsdp, ep = mesh.shape[TP], mesh.shape[FSDP], mesh.shape[EP]
    experts = len(shape) == 3 and ep > 1
    if experts:
        if shape[0] % ep:
            raise ValueError(f"learner.mesh.ep={ep} does not divide the model's {shape[0]} experts")
        axes[0] = EP
    if tp > 1:
        for dim in reversed(range(len(shape))):
            if axes[dim] is None and shape[dim] % tp == 0:
                axes[dim] = TP
                break
    data: list[tuple[str | tuple[str, str], int]] = [(FSDP, fsdp)]
    if ep > 1 and not experts:
        data.insert(0, ((FSDP, EP), fsdp * ep))
    for name, size in data:
        if size <= 1:
            continue
        candidates = [d for d in range(len(shape)) if axes[d] is None and shape[d] % size == 0]
        if candidates:
            axes[max(candidates, key=lambda d: shape[d])] = name
            break
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
    the row axes, tokens over tp (each layer's saved input is 1/tp per device)."""
    return NamedSharding(mesh, PartitionSpec(row_axes(mesh), TP, None))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[rows, T] batch arrays: rows split over fsdp x ep, replicated over tp."""
    return NamedSharding(mesh, PartitionSpec(row_axes(mesh), None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch rows split: fsdp x ep."""
    return int(mesh.shape[FSDP] * mesh.shape[EP])


def expert_layout(mesh: Mesh, num_experts: int, capacity_factor: float | None) -> ExpertLayout | None:
    """Where a model with ``num_experts`` computes them on this mesh: E over ep, their width over
    tp, tokens sent to them by all-to-all. None (every device runs every expert on its tokens,
    as the sampler does) for a dense model, or with neither an expert axis nor a capacity. (The
    rows name ep even at size 1: the all-to-all's output varies over it.)"""
    if not num_experts or (mesh.shape[EP] == 1 and capacity_factor is None):
        return None
    return ExpertLayout(mesh, (FSDP, EP), EP, TP, capacity_factor)
