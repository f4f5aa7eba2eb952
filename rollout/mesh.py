"""The rollout server's mesh: tensor parallelism over the chips of its own host.

One axis, ``tp``. Column-parallel projections (q/k/v, gate/up, the vocabulary of the embedding and
the LM head) split their output features over it, row-parallel ones (o_proj, down_proj) their
input features, so each chip holds 1/tp of every large matrix; the KV cache splits over its
key/value heads. The Sampler's programs are unchanged: XLA's SPMD partitioner propagates these
layouts through them and inserts the all-reduces they imply. A projection whose heads (or a
vocabulary, an MLP width) the mesh does not divide stays replicated, which is correct, only less
memory-saving.
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


def default_tp(config: TransformerConfig, devices: Sequence[jax.Device]) -> int:
    """All local chips of an accelerator, or the most of them that divides the attention heads
    (so each chip holds whole heads); 1 on the CPU, where extra devices are the same cores."""
    if not devices or devices[0].platform == "cpu":
        return 1
    return max(n for n in range(1, len(devices) + 1) if config.num_heads % n == 0)


def rollout_mesh(config: TransformerConfig, tp: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``tp`` mesh over the first ``tp`` of ``devices`` (this process's local devices when
    None; ``tp`` None: ``default_tp``)."""
    devs = list(jax.local_devices() if devices is None else devices)
    size = default_tp(config, devs) if tp is None else tp
    if size > len(devs):
        raise MeshError(f"--mesh tp={size}: this process has only {len(devs)} {devs[0].platform} device(s)")
    if config.num_heads % size:
        raise MeshError(f"--mesh tp={size} does not divide the model's {config.num_heads} attention heads")
    return Mesh(np.asarray(devs[:size]), (TP,))


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
