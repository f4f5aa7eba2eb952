"""The rollout server's mesh: tensor parallelism over its chips (every host's, multi-host).

One axis, ``tp``. Column-parallel projections (q/k/v, gate/up, the vocabulary of the embedding and
the LM head) split their output features over it, row-parallel ones (o_proj, down_proj) their
input features, so each chip holds 1/tp of every large matrix; the KV cache splits over its
key/value heads. The Sampler's programs are unchanged: XLA's SPMD partitioner propagates these
layouts through them and inserts the all-reduces they imply. A projection whose heads (or a
vocabulary, an MLP width) the mesh does not divide stays replicated, which is correct, only less
memory-saving. A mixture of experts' stacks [E, hidden, width] split over their experts (each chip
holds E/tp whole experts and adds its experts' share of every token's sum: expert parallelism on
the same axis), or over their width when tp does not divide E.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stoker.spec import TransformerConfig

TP = "tp"
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


class MeshError(ValueError):
    """A ``--mesh`` that the devices or the model cannot take."""


def parse_mesh(text: str) -> int:
    """``tp=N`` -> N (the only axis a rollout mesh has)."""
    name, _, value = text.partition("=")
    if name.strip() != TP or not value.strip().isdigit() or int(value) < 1:
        raise MeshError(f"--mesh {text!r}: expected tp=N with N >= 1")
    return int(value)


def default_tp(config: TransformerConfig, devices: Sequence[jax.Device], processes: int = 1) -> int:
    """All chips of an accelerator, or the most of them that divides the attention heads (so
    each chip holds whole heads) and takes as many chips from every host; on the CPU 1 per
    process, where extra devices are the same cores."""
    if not devices:
        return 1
    if devices[0].platform == "cpu":
        return processes
    fits = [n for n in range(processes, len(devices) + 1, processes) if config.num_heads % n == 0]
    if not fits:
        raise MeshError(
            f"no tensor-parallel size divides the model's {config.num_heads} attention heads and spreads evenly "
            f"over {processes} hosts; set --mesh tp=N"
        )
    return max(fits)


def rollout_mesh(config: TransformerConfig, tp: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``tp`` mesh over ``tp`` of ``devices`` (None: every process's devices; ``tp`` None:
    ``default_tp``). Over several processes it takes the same number of devices from each, in
    process order, since every host runs the same programs and holds a part of the model."""
    devs = list(jax.devices() if devices is None else devices)
    processes = len({d.process_index for d in devs})
    size = default_tp(config, devs, processes) if tp is None else tp
    if size > len(devs):
        raise MeshError(f"tp={size}: the server has only {len(devs)} {devs[0].platform} device(s)")
    if size % processes:
        raise MeshError(f"tp={size} does not spread evenly over the server's {processes} hosts")
    if config.num_heads % size:
        raise MeshError(f"tp={size} does not divide the model's {config.num_heads} attention heads")
    per_host = size // processes
    by_host: dict[int, list[jax.Device]] = {}
    for d in devs:
        by_host.setdefault(d.process_index, []).append(d)
    if min(len(v) for v in by_host.values()) < per_host:
        raise MeshError(f"tp={size} needs {per_host} devices on each of {processes} hosts")
    chosen = [d for host in sorted(by_host) for d in by_host[host][:per_host]]
    return Mesh(np.asarray(chosen), (TP,))


def _module_of(path: Sequence[Any]) -> tuple[str, str]:
    """(the module a parameter belongs to, the parameter's own name) from its state path."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[-1] == "value":  # the nnx.Variable holding the array
        names.pop()
    return (names[-2] if len(names) > 1 else ""), names[-1]


def param_spec(path: Sequence[Any], shape: Sequence[int], config: TransformerConfig, tp: int) -> PartitionSpec:
    """Where one parameter splits over ``tp`` (see the module doc)."""
    module, name = _module_of(path)
    axes: list[str | None] = [None] * len(shape)
    if tp == 1:
        return PartitionSpec(*axes)
    if module == "experts":  # a stack [E, hidden, width] (stoker.model.moe)
        dim = 0 if shape[0] % tp == 0 else 2
        axes[dim] = TP if shape[dim] % tp == 0 else None
        return PartitionSpec(*axes)
    if module in ("k_proj", "v_proj") and config.num_kv_heads % tp:
        return PartitionSpec(*axes)  # a key/value head never splits across chips
    if module in COLUMN_PARALLEL:
        dim = len(shape) - 1  # kernel [in, out] and bias [out]: the output features
    elif module in ROW_PARALLEL and name == "kernel":
        dim = 0  # the input features; the partial sums are all-reduced
    elif module == "embed_tokens":
        dim = 0  # the vocabulary (also the LM head's when tied)
    else:
        return PartitionSpec(*axes)  # norms, row-parallel biases
    if shape[dim] % tp == 0:
        axes[dim] = TP
    return PartitionSpec(*axes)


def param_shardings(state: Any, config: TransformerConfig, mesh: Mesh) -> Any:
    """A NamedSharding for every parameter of an ``nnx.State``."""
    tp = int(mesh.shape[TP])
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, np.shape(x), config, tp)), state
    )


def cache_sharding(config: TransformerConfig, mesh: Mesh) -> NamedSharding:
    """KV cache [rows, slots, kv_heads, head_dim]: split over its heads when tp divides them."""
    tp = int(mesh.shape[TP])
    heads = TP if config.num_kv_heads % tp == 0 and tp > 1 else None
    return NamedSharding(mesh, PartitionSpec(None, None, heads, None))
