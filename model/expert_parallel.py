"""Experts computed where they live: each device of the expert axis holds E/ep whole experts,
and every token travels to the devices of its k experts and back (GShard, arXiv:2006.16668;
Switch Transformer, arXiv:2101.03961), under ``shard_map``:

    dispatch  each device puts its tokens' (token, choice) pairs into a buffer [E, C, hidden],
              slot = the pair's place among its expert's pairs on this device (token order);
    all-to-all over ``ep``: device d sends the slice of experts device j holds to device j;
    experts   each device runs its E/ep experts on the [ep, E/ep, C] rows it received (the
              width split over ``tp``, the down projection's partial sums added over tp);
    all-to-all back, then combine: a token's output is the sum of its k rows, each already
              scaled by its gate (applied before the down projection, as the dense path does).

C, each expert's capacity per device: the device's tokens by default, which no expert can
exceed (a token chooses an expert once), so no token is ever dropped and the sum is exactly the
dense computation's. With a capacity factor f, C = ceil(f * k * N / E) for N tokens: matmul
work near the routed k * N rows, and pairs past C dropped (counted). Padding (segment 0) never
takes a slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec


@dataclass(frozen=True)
class ExpertLayout:
    """Where the learner computes a mixture of experts: ``mesh``'s ``expert_axis`` splits the
    experts, ``row_axes`` the batch rows (expert axis included: it is data parallel outside the
    experts), ``tensor_axis`` (or None) the experts' width; ``capacity_factor`` None: no drops."""

    mesh: Mesh
    row_axes: tuple[str, ...]
    expert_axis: str
    tensor_axis: str | None
    capacity_factor: float | None = None


def expert_capacity(tokens: int, k: int, experts: int, factor: float | None) -> int:
    """Slots per expert per device for ``tokens`` tokens choosing ``k`` of ``experts`` each."""
    if factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(factor * k * tokens / experts)))


def routed_experts(
    x: jax.Array, index: jax.Array, weight: jax.Array, valid: jax.Array,
    kernels: tuple[jax.Array, jax.Array, jax.Array], layout: ExpertLayout,
) -> tuple[jax.Array, jax.Array]:
    """The experts' output for tokens ``x`` [B, T, hidden] routed to ``index`` [B, T, k] with
    gates ``weight`` (x's dtype), and the (token, choice) pairs dropped for capacity (a float
    count over the batch). ``kernels``: gate, up, down, each [E, hidden, width]."""
    mesh, ep_axis, tp_axis = layout.mesh, layout.expert_axis, layout.tensor_axis
    ep = int(mesh.shape[ep_axis])
    num_experts, width = kernels[0].shape[0], kernels[0].shape[-1]
    if num_experts % ep:
        raise ValueError(f"learner.mesh.ep={ep} does not divide the model's {num_experts} experts")
    tp = tp_axis if tp_axis is not None and width % int(mesh.shape[tp_axis]) == 0 and mesh.shape[tp_axis] > 1 else None
    rows = PartitionSpec(layout.row_axes)
    kernel = PartitionSpec(ep_axis, None, tp)
    local = partial(_local_experts, num_experts=num_experts, ep_axis=ep_axis, tp_axis=tp,
                    capacity_factor=layout.capacity_factor)
    out, dropped = jax.shard_map(
        local, mesh=mesh,
        in_specs=(rows, rows, rows, rows, (kernel, kernel, kernel)),
        out_specs=(rows, PartitionSpec(layout.row_axes)),
    )(x, index, weight, valid, kernels)
    return out, jnp.sum(dropped)


def _local_experts(
    x: jax.Array, index: jax.Array, weight: jax.Array, valid: jax.Array,
    kernels: tuple[jax.Array, jax.Array, jax.Array], *, num_experts: int, ep_axis: str, tp_axis: str | None,
    capacity_factor: float | None,
) -> tuple[jax.Array, jax.Array]:
    """One device's part of ``routed_experts``: its rows' tokens, its E/ep experts."""
    shape, hidden = x.shape, x.shape[-1]
    k = index.shape[-1]
    tokens = x.reshape(-1, hidden)
    n = tokens.shape[0]
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    expert = index.reshape(-1)  # [n*k] pairs in token order, a token's choices in rank order
    real = jnp.repeat(valid.reshape(-1), k)
    chosen = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32) * real[:, None]
    slot = jnp.sum((jnp.cumsum(chosen, axis=0) - 1) * chosen, axis=-1)  # place among the expert's pairs
    kept = real & (slot < capacity)
    slot = jnp.where(kept, slot, capacity)  # out of range: scatters drop it, gathers read 0
    source = jnp.repeat(jnp.arange(n), k)
    rows = jnp.zeros((num_experts, capacity, hidden), x.dtype).at[expert, slot].set(tokens[source], mode="drop")
    gates = jnp.zeros((num_experts, capacity), x.dtype).at[expert, slot].set(weight.reshape(-1), mode="drop")

    ep = num_experts // kernels[0].shape[0]
    # [ep, E/ep, C, ...]: slice j goes to device j of the expert axis; what arrives is indexed by sender.
    rows = jax.lax.all_to_all(rows.reshape(ep, -1, capacity, hidden), ep_axis, 0, 0)
    gates = jax.lax.all_to_all(gates.reshape(ep, -1, capacity), ep_axis, 0, 0)
    # (At ep = 1 these are no-ops that XLA removes; kept so the values vary over ep as out_specs say.)
    gate, up, down = kernels
    act = jax.nn.silu(jnp.einsum("secd,edf->secf", rows, gate)) * jnp.einsum("secd,edf->secf", rows, up)
    out = jnp.einsum("secf,edf->secd", act * gates[..., None], down)
    if tp_axis is not None:  # each tp device held a slice of the width: add the partial sums
        out = jax.lax.psum(out, tp_axis)
    out = jax.lax.all_to_all(out, ep_axis, 0, 0).reshape(num_experts, capacity, hidden)

    pairs = out.at[expert, slot].get(mode="fill", fill_value=0)  # [n*k, hidden], 0 where dropped
    combined = jnp.sum(pairs.reshape(n, k, hidden), axis=1).reshape(shape)
    dropped = jnp.sum(real & ~kept).astype(jnp.float32)
    return combined, dropped[None]
