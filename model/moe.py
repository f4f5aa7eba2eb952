"""Mixture-of-experts layers (Mixtral, arXiv:2401.04088; Qwen3-MoE, the Qwen3 technical report,
arXiv:2505.09388): the MLP of a sparse layer is a router and ``num_experts`` SwiGLU experts,

    p = softmax(W_router x)                        (float32, over the experts)
    S = the k experts with the largest p            (top-k, k = num_experts_per_tok)
    g_e = p_e / sum_{j in S} p_j  if norm_topk_prob (Mixtral: always), else p_e,   for e in S
    y = sum_{e in S} g_e * W_down,e (silu(W_gate,e x) * W_up,e x).

The experts are held stacked, all three projections as [E, hidden, expert_size] (``Experts``:
down_proj as the checkpoint stores it, [hidden, expert_size] per expert, used transposed), so one
einsum runs them all and one shape rule shards them (the expert axis, then the width over tp:
``stoker.learner.sharding``). Checkpoints store them one expert at a time, and ``split_experts`` /
``stack_experts`` map between the two at the checkpoint boundary (``stoker.model.hf``). Inside
Stoker (the weight channel, the shard format) a stack travels whole under its own name,
``hf_name``'s ``model.layers.N.mlp.experts.gate_proj``.

Where to compute them: densely (every expert on every token, the gates zero off the chosen k) by
default, or, inside a learner's ``ExpertLayout``, by sending each token to its experts' devices
(``stoker.model.expert_parallel``). Both compute the same sum.

The same ``SparseMoE.__call__`` runs in the learner's training forward and the sampler's
prefill, extend and decode, so both route every token alike and their log-probs agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.hf_experts import MIXTRAL_BLOCK, expert_weight_name
from stoker.model.expert_parallel import routed_experts
from stoker.model.training_layout import expert_layout
from stoker.spec import TransformerConfig

# The stacked projections (Stoker's names; Mixtral's checkpoints call them w1, w3, w2).
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Routing(NamedTuple):
    """One MoE layer's routing of tokens [..., hidden]: float32 over the last axis, E experts."""

    probs: jax.Array  # [..., E] softmax of the router logits
    gates: jax.Array  # [..., E] g_e on the chosen experts, exactly 0 elsewhere
    chosen: jax.Array  # [..., E] 1.0 where the expert is among the token's top k, else 0.0
    top_experts: jax.Array  # [..., k] the chosen experts, largest probability first
    top_gates: jax.Array  # [..., k] their g_e


def route(logits: jax.Array, k: int, normalise: bool) -> Routing:
    """Softmax over the experts in float32, the top ``k``, renormalised when ``normalise``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, index = jax.lax.top_k(probs, k)
    if normalise:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(index, probs.shape[-1], dtype=jnp.float32)  # [..., k, E]
    return Routing(probs, jnp.einsum("...k,...ke->...e", top, one_hot), jnp.sum(one_hot, axis=-2), index, top)


class RouterStats(NamedTuple):
    """Sums over the sparse layers of a forward and their real tokens (segment id > 0), for the
    load-balancing loss and the expert-load metrics."""

    load: jax.Array  # [E] how many (layer, token)s chose each expert (sum over experts: k * tokens)
    probs: jax.Array  # [E] the routing probabilities summed
    tokens: jax.Array  # [] (layer, token)s routed
    dropped: jax.Array  # [] (layer, token, choice)s an expert's capacity turned away (0 without one)

    @staticmethod
    def zeros(num_experts: int) -> RouterStats:
        return RouterStats(
            jnp.zeros(num_experts, jnp.float32), jnp.zeros(num_experts, jnp.float32), jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
        )

    def __add__(self, other: object) -> RouterStats:  # elementwise, not tuple concatenation
        if not isinstance(other, RouterStats):
            return NotImplemented
        return RouterStats(*(a + b for a, b in zip(self, other, strict=True)))


def router_stats(routing: Routing, valid: jax.Array, dropped: jax.Array | None = None) -> RouterStats:
    """``routing``'s sums over the tokens where ``valid`` [...] is true."""
    weight = valid.astype(jnp.float32)[..., None]
    axes = tuple(range(weight.ndim - 1))
    return RouterStats(
        jnp.sum(jax.lax.stop_gradient(routing.chosen) * weight, axis=axes),
        jnp.sum(routing.probs * weight, axis=axes),
        jnp.sum(weight),
        jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32),
    )


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """The Switch Transformer's auxiliary loss (arXiv:2101.03961, eq. 4) with top-k routing, over
    every sparse layer's real tokens pooled, as Hugging Face's ``router_aux_loss_coef`` weights it:

        loss = E * sum_e f_e * P_e,   f_e = (# (layer, token)s routed to e) / N,
                                      P_e = (sum of their probabilities p_e) / N,

    N the (layer, token)s. f carries no gradient (a top-k choice); P does, pulling the router
    toward uniform probabilities where the load is high. A perfectly balanced router gives k."""
    n = jnp.maximum(stats.tokens, 1.0)
    return stats.load.shape[0] * jnp.sum((stats.load / n) * (stats.probs / n))


class Experts(nnx.Module):
    """``num_experts`` SwiGLU MLPs of width ``expert_size``, their kernels stacked on a leading
    axis, each [E, hidden, expert_size] (down_proj used transposed)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, hidden, inter = config.num_experts, config.hidden_size, config.expert_size
        # nnx.Linear's default (LeCun normal over the input features), one expert at a time.
        into = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        out_of = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        self.gate_proj = nnx.Param(into(rngs.params(), (e, hidden, inter), dtype))
        self.up_proj = nnx.Param(into(rngs.params(), (e, hidden, inter), dtype))
        self.down_proj = nnx.Param(out_of(rngs.params(), (e, hidden, inter), dtype))

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        """sum_e gates[..., e] * expert_e(x) for x [..., hidden], gates [..., E] (x's dtype).

        Every expert runs on every token and the gates (exactly 0 off the chosen k) pick the
        result: the routed sum, at E/k times its matmul FLOPs and with [..., E, expert_size]
        activations. Fine for the sampler's small batches and the CPU; the learner's
        ``ExpertLayout`` sends tokens to their experts instead."""
        w = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        act = jax.nn.silu(jnp.einsum("...d,edf->...ef", x, w[0])) * jnp.einsum("...d,edf->...ef", x, w[1])
        return jnp.einsum("...ef,edf->...d", act * gates[..., None], w[2])


class SparseMoE(nnx.Module):
    """The MLP of a mixture-of-experts layer: the router (Hugging Face's ``gate``) and the experts."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        self.normalise = config.norm_topk_prob
        self.gate = nnx.Linear(
            config.hidden_size, config.num_experts, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.experts = Experts(config, dtype=dtype, rngs=rngs)

    def routing(self, x: jax.Array) -> Routing:
        """How tokens ``x`` [..., hidden] are routed (the router's logits in the model's dtype)."""
        return route(self.gate(x), self.top_k, self.normalise)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.with_stats(x, jnp.ones(x.shape[:-1], bool))[0]

    def with_stats(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, RouterStats]:
        """``self(x)`` and its routing's sums over the ``valid`` tokens (the learner's forward).
        Inside an ``ExpertLayout`` the tokens travel to their experts (and an expert with a
        capacity may turn some away: counted in the sums); elsewhere every expert runs densely."""
        routing = self.routing(x)
        layout = expert_layout()
        if layout is None:
            return self.experts(x, routing.gates.astype(x.dtype)), router_stats(routing, valid)
        e = self.experts
        out, dropped = routed_experts(
            x, routing.top_experts, routing.top_gates.astype(x.dtype), valid, (e.gate_proj[...], e.up_proj[...], e.down_proj[...]),
            layout,
        )
        return out, router_stats(routing, valid, dropped)


# ------------------------------------------------------------------ checkpoint names


def is_expert_stack(module: tuple[str, ...], leaf: str) -> bool:
    """Whether an NNX parameter path (its modules, its leaf) is a stack of experts' kernels."""
    return bool(module) and module[-1] == "experts" and leaf in EXPERT_PROJECTIONS


def _expert_names(stacked: str, num_experts: int, mixtral: bool) -> list[str]:
    """``model.layers.N.mlp.experts.gate_proj`` -> its experts' checkpoint names, in order."""
    parts = stacked.split(".")  # model, layers, N, mlp, experts, projection
    layer, projection = int(parts[2]), parts[-1]
    return [expert_weight_name(layer, e, projection, mixtral) for e in range(num_experts)]


def checkpoint_name(name: str, mixtral: bool) -> str:
    """A (non-expert) Stoker name as the checkpoint has it: Mixtral calls a layer's MoE block
    ``block_sparse_moe`` (its router ``block_sparse_moe.gate``) where Stoker says ``mlp``."""
    return name.replace(".mlp.", f".{MIXTRAL_BLOCK}.", 1) if mixtral else name


def _stored_transposed(stacked: str) -> bool:
    """Whether a stack's experts are the transposes of the checkpoint's tensors ([out, in],
    PyTorch's layout): gate and up are; down is kept as stored, [hidden, width]."""
    return not stacked.endswith("down_proj")


def split_experts(stacked: str, array: np.ndarray, mixtral: bool) -> dict[str, np.ndarray]:
    """A stack [E, hidden, width] as the checkpoint's per-expert tensors, each [out, in]."""
    names = _expert_names(stacked, array.shape[0], mixtral)
    if not _stored_transposed(stacked):
        return {name: np.ascontiguousarray(array[e]) for e, name in enumerate(names)}
    return {name: np.ascontiguousarray(array[e].T) for e, name in enumerate(names)}


def stack_experts(
    flat: Mapping[str, np.ndarray], stacked: str, num_experts: int, mixtral: bool
) -> tuple[np.ndarray, list[str]] | None:
    """The stack [E, hidden, width] a checkpoint's per-expert tensors make, and their names; None if
    the checkpoint lacks any of them (it may hold the stack itself, as the weight channel sends
    it; a checkpoint missing some experts is left for ``load_hf`` to report)."""
    names = _expert_names(stacked, num_experts, mixtral)
    if not all(n in flat for n in names):
        return None
    # One host copy of the stack: every expert's tensor is read here (memory-mapped files too).
    if not _stored_transposed(stacked):
        return np.stack([np.asarray(flat[n]) for n in names]), names
    return np.stack([np.asarray(flat[n]).T for n in names]), names
