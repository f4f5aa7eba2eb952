"""The policy: a decoder-only transformer of the Llama, Qwen and Gemma families, in Flax NNX.

One implementation serves the learner (packed training forward) and the actors' sampler (prefill
plus KV-cached decode, see ``stoker.rollout.sampling``). Submodules carry Hugging Face's names
(``embed_tokens``, ``layers.N.self_attn.q_proj`` ...) so the checkpoint mapping in
``stoker.model.hf`` is a rename plus a transpose. The layers are in ``stoker.model.layers``; this
module stacks and runs them (the equations: ``Transformer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.model.attention import Visibility
from stoker.model.attention_kernels import Implementation
from stoker.model.init import init_module as init_module  # re-exported: the critic's init
from stoker.model.decode_attention import key_positions
from stoker.model.layers import Block, LayerCache, norm_layer
from stoker.model.logprobs import OutputHead
from stoker.model.moe import RouterStats
from stoker.model.training_layout import place_residual, place_stacked
from stoker.spec import TransformerConfig

# Hugging Face's ``initializer_range``: small embeddings keep the initial policy near uniform,
# which is what exploration in RL wants when the head is tied to the embedding.
EMBED_INIT_STDDEV = 0.02

# What a rematerialised layer keeps for the backward pass (``ModelSpec.remat``).
RematPolicy = Literal["none", "full", "save-matmuls"]
_REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,  # only the layer's input: everything inside is recomputed
    "save-matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class KVCache(NamedTuple):
    """The sampler's cache. Slot s of row b holds the token at position s of that row's sequence;
    ``segment_ids[b, s]`` is nonzero once the slot holds a real token."""

    layers: tuple[LayerCache, ...]
    segment_ids: jax.Array  # [B, S] int32


def packed_visibility(segment_ids: jax.Array) -> Visibility:
    """Query t sees key s iff s <= t and both lie in the same nonzero segment (token indices)."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    return Visibility(index, index, segment_ids, segment_ids)


LayerStep = Callable[[jax.Array, jax.Array, Visibility, jax.Array], tuple[jax.Array, RouterStats]]


def _routed(
    block: Block, h: jax.Array, positions: jax.Array, vis: Visibility, valid: jax.Array, kernel: Implementation,
    num_experts: int,
) -> tuple[jax.Array, RouterStats]:
    """One layer of the training forward: new h and its routing sums (zeros for a dense layer, so
    that every layer of a scanned group returns the same structure)."""
    h, stats = block.routed(h, positions, vis, valid, kernel)
    return h, stats if stats is not None else RouterStats.zeros(num_experts)


def _remat_block(block: Block, policy: RematPolicy, kernel: Implementation, num_experts: int) -> LayerStep:
    """``block`` as (h, positions, vis, valid) -> (h, routing sums), rematerialised under
    ``policy`` (the backward recomputes its insides)."""
    if policy == "none":
        return lambda h, positions, vis, valid: _routed(block, h, positions, vis, valid, kernel, num_experts)
    if policy not in _REMAT_POLICIES:
        raise ValueError(f"remat policy {policy!r}; expected one of none, {', '.join(_REMAT_POLICIES)}")
    graphdef, state = nnx.split(block)

    def step(
        state: Any, h: jax.Array, positions: jax.Array, vis: Visibility, valid: jax.Array
    ) -> tuple[jax.Array, RouterStats]:
        return _routed(nnx.merge(graphdef, state), h, positions, vis, valid, kernel, num_experts)

    # Unrolled checkpointed layers: XLA's CPU pipeline drops the barriers that keep the
    # recomputation apart and merges it back into the forward pass (benchmarks/README.md,
    # "Learner memory"), so most layers go through _scan_layers; this serves the few left over.
    stepped = jax.checkpoint(step, policy=_REMAT_POLICIES[policy], prevent_cse=True)
    return lambda h, positions, vis, valid: stepped(state, h, positions, vis, valid)


def layer_period(config: TransformerConfig) -> int:
    """The smallest p with layer i built like layer i % p throughout (local or global attention,
    dense MLP or experts): the group ``_scan_layers`` stacks, whose states must share a structure."""
    kinds = [(config.is_local_layer(i), config.is_moe_layer(i)) for i in range(config.num_layers)]
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def _scan_layers(
    layers: list[Block], h: jax.Array, positions: jax.Array, vis: Visibility, valid: jax.Array, policy: RematPolicy,
    period: int, kernel: Implementation, num_experts: int,
) -> tuple[jax.Array, RouterStats, list[Block]]:
    """Run the leading groups of ``period`` layers (layers alike at the same place in their group:
    Gemma's local/global pattern) as a ``lax.scan`` over their stacked parameters, each group
    rematerialised; return h, the groups' routing sums and the layers left over (fewer than ``period``).

    A loop, unlike unrolled checkpointed layers, keeps each group's recomputation inside the
    backward loop's body, where no compiler pass can merge it into the forward pass. The stacked
    copy of the layers' parameters (and of their gradients) is the price: ~2x the layers' weights."""
    groups = len(layers) // period
    if groups < 2:
        return h, RouterStats.zeros(num_experts), layers
    graphdef, _ = nnx.split(nnx.List(layers[:period]))
    states = [nnx.split(nnx.List(layers[g * period : (g + 1) * period]))[1] for g in range(groups)]
    stacked = place_stacked(jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def body(carry: tuple[jax.Array, RouterStats], state: Any) -> tuple[tuple[jax.Array, RouterStats], None]:
        h, sums = carry
        for block in nnx.merge(graphdef, state):
            h, stats = _routed(block, place_residual(h), positions, vis, valid, kernel, num_experts)
            h, sums = place_residual(h), sums + stats
        return (h, sums), None

    scanned = jax.checkpoint(body, policy=_REMAT_POLICIES[policy], prevent_cse=True)
    (h, sums), _ = jax.lax.scan(scanned, (h, RouterStats.zeros(num_experts)), stacked)
    return h, sums, layers[groups * period :]


class Transformer(nnx.Module):
    """Decoder-only language model sized by ``TransformerConfig``.

    Llama/Qwen blocks are the pre-norm residual pair

        h = x + Attn(RMSNorm(x)),        y = h + MLP(RMSNorm(h)),
        RMSNorm(x) = w * x / sqrt(mean(x^2) + eps),
        MLP(x) = W_down (silu(W_gate x) * W_up x)                       (SwiGLU),

    with rotary position embeddings on queries and keys (``stoker.model.rope``) and grouped-query
    attention (``stoker.model.attention``). Gemma 2 (arXiv:2408.00118) and Gemma 3
    (arXiv:2503.19786) change, each behind a ``TransformerConfig`` field:

        h = x + RMSNorm(Attn(RMSNorm(x))),  y = h + RMSNorm(MLP(RMSNorm(h)))    (sandwichNorms)
        RMSNorm scales by (1 + w)                                           (normUnitOffset)
        MLP gate gelu(tanh approximation), i.e. GeGLU                       (mlpActivation)
        token embeddings times sqrt(hidden)                                 (embeddingScale)
        scores scaled by query_pre_attn_scalar^-1/2, soft-capped            (Gemma 2)
        local layers attend within a sliding window; Gemma 3 gives them their own rotary base
        and normalises each query/key head (qkNorm); final logits soft-capped (Gemma 2).

    Qwen3-MoE and Mixtral replace the MLP of their sparse layers by a router and top-k experts
    (``stoker.model.moe``, selected by ``TransformerConfig.is_moe_layer``).

    Packed rows: ``segment_ids`` label which sequence each token belongs to (0 = padding). A query
    attends to key j only if both share the same nonzero segment and j is not after it, so
    sequences packed side by side never see each other; ``positions`` restart at 0 for each."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=nnx.initializers.normal(EMBED_INIT_STDDEV),
            rngs=rngs,
        )
        self.layers = nnx.List([Block(config, dtype=dtype, rngs=rngs, layer=i) for i in range(config.num_layers)])
        self.norm = norm_layer(config, config.hidden_size, dtype)
        self.lm_head: nnx.Linear | None = (
            None
            if config.tie_embeddings
            else nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=dtype,
                param_dtype=dtype,
                kernel_init=nnx.initializers.normal(EMBED_INIT_STDDEV),
                rngs=rngs,
            )
        )

    def embed(self, token_ids: jax.Array) -> jax.Array:
        h = self.embed_tokens(token_ids)
        if self.config.embedding_scale:  # Gemma: the normaliser is rounded to the model's dtype
            h = h * jnp.asarray(math.sqrt(self.config.hidden_size), h.dtype)
        return h

    def output_head(self) -> OutputHead:
        """The final projection (applied to ``self.norm``'s output), for ``logprobs.token_stats``."""
        if self.lm_head is None:
            return OutputHead(self.embed_tokens.embedding[...], True, self.config.final_logit_softcap)
        return OutputHead(self.lm_head.kernel[...], False, self.config.final_logit_softcap)

    def _output(self, h: jax.Array, head: bool) -> jax.Array:  # the logits; ``head`` off, the head's input
        return self.output_head().logits(self.norm(h)) if head else self.norm(h)

    def hidden_states(
        self, token_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array, *, remat: RematPolicy = "none",
        kernel: Implementation = "blockwise",
    ) -> jax.Array:
        """Training forward over packed rows up to the final norm: [B, T] x3 -> [B, T, hidden].

        ``remat``: rematerialise each layer (``ModelSpec.remat``); ``kernel``: the attention
        implementation (``ModelSpec.attention``, resolved); the values are the same."""
        return self.hidden_states_and_routing(token_ids, positions, segment_ids, remat=remat, kernel=kernel)[0]

    def hidden_states_and_routing(
        self, token_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array, *, remat: RematPolicy = "none",
        kernel: Implementation = "blockwise",
    ) -> tuple[jax.Array, RouterStats]:
        """``hidden_states`` and the sparse layers' routing sums over the real tokens (segment id
        > 0; [0]-shaped for a dense model), for the load-balancing loss (``stoker.model.moe``)."""
        vis = packed_visibility(segment_ids)
        valid = segment_ids > 0
        experts = self.config.num_experts
        h = place_residual(self.embed(token_ids))
        layers = list(self.layers)
        sums = RouterStats.zeros(experts)
        if remat != "none":
            h, sums, layers = _scan_layers(
                layers, h, positions, vis, valid, remat, layer_period(self.config), kernel, experts
            )
        for block in layers:
            h, stats = _remat_block(block, remat, kernel, experts)(h, positions, vis, valid)
            h, sums = place_residual(h), sums + stats
        return self.norm(h), sums

    def __call__(
        self, token_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array, kernel: Implementation = "blockwise"
    ) -> jax.Array:
        """Training forward over packed rows: int32 [B, T] x3 -> float32 logits [B, T, V].

        ``logits[b, t]`` predicts the token after ``token_ids[b, t]``."""
        return self.output_head().logits(self.hidden_states(token_ids, positions, segment_ids, kernel=kernel))

    def prefill(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        cache_len: int | None,
        logits_at: jax.Array | None = None,
        head: bool = True,
    ) -> tuple[jax.Array, KVCache | None]:
        """Forward over [B, T] tokens; with ``cache_len`` (>= T) also return a KV cache whose
        first T slots hold these tokens' keys and values (the sampler's prefill).

        ``logits_at`` [B]: logits [B, V] at just that index of each row (the head on B vectors, not
        B * T). ``head`` off: the head's input (the final norm's output) instead, for the sampler."""
        vis = packed_visibility(segment_ids)
        h = self.embed(token_ids)
        layer_caches: list[LayerCache] = []
        for block in self.layers:
            h, (k, v) = block(h, positions, vis)
            if cache_len is not None:
                pad = ((0, 0), (0, cache_len - k.shape[1]), (0, 0), (0, 0))
                layer_caches.append(LayerCache(jnp.pad(k, pad), jnp.pad(v, pad)))
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)[:, 0]
        logits = self._output(h, head)
        if cache_len is None:
            return logits, None
        segments = jnp.pad(segment_ids, ((0, 0), (0, cache_len - segment_ids.shape[1])))
        return logits, KVCache(tuple(layer_caches), segments)

    def extend(
        self, token_ids: jax.Array, positions: jax.Array, valid: jax.Array, cache: KVCache, *,
        logits_at: jax.Array, head: bool = True,
    ) -> tuple[jax.Array, KVCache]:
        """Append a chunk of tokens to cached sequences (the sampler's prefill when a
        conversation's earlier turns are already cached).

        ``token_ids``, ``positions`` and ``valid`` are [B, C]: row b's chunk continues its cached
        sequence at slots ``positions[b]`` (consecutive, starting where the cached prefix ends);
        invalid entries (chunk padding) are computed but never written. Each token attends to
        every slot up to its own position, i.e. the cached prefix and the chunk before it.
        Returns logits [B, V] at chunk index ``logits_at[b]`` and the cache with the chunk's
        keys and values written, in the cache's layout (flat or not). ``head``: as ``prefill``'s."""
        batch, num_slots = cache.segment_ids.shape
        slots = jnp.arange(num_slots, dtype=jnp.int32)
        rows = jnp.arange(batch)[:, None]
        write = jnp.where(valid, positions, num_slots)  # out of range: dropped by the scatter
        filled = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
        ones_q = jnp.ones(positions.shape, jnp.int32)
        vis = Visibility(positions, jnp.broadcast_to(slots, (batch, num_slots)), ones_q, jnp.ones((batch, num_slots), jnp.int32))
        h = self.embed(token_ids)
        new_layers: list[LayerCache] = []
        for block, layer in zip(self.layers, cache.layers, strict=True):
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, positions)
            heads = k.shape[2:]
            if layer.keys.ndim == 3:  # a flat cache (``flatten_cache``)
                k, v = k.reshape(*k.shape[:2], -1), v.reshape(*v.shape[:2], -1)
            keys = layer.keys.at[rows, write].set(k, mode="drop")
            values = layer.values.at[rows, write].set(v, mode="drop")
            new_layers.append(LayerCache(keys, values))
            h = block.finish(h, block.self_attn(
                x, positions, keys.reshape(batch, num_slots, *heads), values.reshape(batch, num_slots, *heads), vis
            ))
        logits = self._output(jnp.take_along_axis(h, logits_at[:, None, None], axis=1), head)[:, 0]
        segments = (slots[None, :] < filled[:, None]).astype(jnp.int32)
        return logits, KVCache(tuple(new_layers), segments)

    def decode(
        self, token_ids: jax.Array, positions: jax.Array, cache: KVCache, *, slot: jax.Array | None = None,
        start: jax.Array | None = None, interpret: bool | None = None, head: bool = True,
    ) -> tuple[jax.Array, KVCache]:
        """One cached step: token [B] at position [B] -> logits [B, V] (``head``: as ``prefill``'s).

        Writes the token's keys/values into slot ``positions[b]`` of row b, then attends over the
        filled slots up to and including it. With ``slot`` (a scalar) every row writes into that
        one slot instead: the sampler's loop (``stoker.rollout.programs.sample_loop``), whose rows
        hold the tokens it generates from slot ``start`` (default ``slot``) on, each row's shifted
        by ``slot - positions[b]`` from its own positions, the slots between its prompt and
        ``start`` unfilled. The write is then one in-place ``dynamic_update_slice`` per layer;
        per-row slots take a select the v5e reads and writes whole (benchmarks/README.md). A flat cache
        (``flatten_cache``) takes the TPU kernels (``_decode_flat``; ``interpret``, default off a
        TPU: in Pallas' interpreter)."""
        if cache.layers[0].keys.ndim == 3:
            if slot is not None:
                raise ValueError("a flat cache is written per row in place: no shared slot")
            interpret = jax.default_backend() != "tpu" if interpret is None else interpret
            return self._decode_flat(token_ids, positions, cache, interpret, head)
        batch, num_slots = cache.segment_ids.shape
        slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (batch, num_slots))
        pos = positions[:, None]
        if slot is None:
            write = slots == pos  # [B, S] one-hot of the slot to fill
            segments, key_positions = jnp.where(write, 1, cache.segment_ids), slots
        else:
            at = jnp.asarray(slot, jnp.int32)
            segments = jax.lax.dynamic_update_slice(cache.segment_ids, jnp.ones((batch, 1), jnp.int32), (0, at))
            # Each slot's position, for causality and sliding windows alike (the gap is unfilled).
            key_positions = jnp.where(slots >= (at if start is None else start), slots - (at - pos), slots)
        vis = Visibility(pos, key_positions, jnp.ones_like(pos), (segments != 0).astype(jnp.int32))
        h = self.embed(token_ids[:, None])
        new_layers: list[LayerCache] = []
        for block, layer in zip(self.layers, cache.layers, strict=True):
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, pos)  # [B, 1, kv, D]
            if slot is None:
                keys = jnp.where(write[:, :, None, None], k, layer.keys)
                values = jnp.where(write[:, :, None, None], v, layer.values)
            else:
                keys = jax.lax.dynamic_update_slice(layer.keys, k.astype(layer.keys.dtype), (0, at, 0, 0))
                values = jax.lax.dynamic_update_slice(layer.values, v.astype(layer.values.dtype), (0, at, 0, 0))
            new_layers.append(LayerCache(keys, values))
            h = block.finish(h, block.self_attn(x, pos, keys, values, vis))
        return self._output(h, head)[:, 0], KVCache(tuple(new_layers), segments)

    def _decode_flat(
        self, token_ids: jax.Array, positions: jax.Array, cache: KVCache, interpret: bool, head: bool
    ) -> tuple[jax.Array, KVCache]:
        """``decode`` over a flat cache (``flatten_cache``): each row's keys and values written in place into
        slot ``positions[b]``, attention over the blocks a row can see (``Attention.decode_step``)."""
        batch, num_slots = cache.segment_ids.shape
        slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (batch, num_slots))
        segments = jnp.where(slots == positions[:, None], 1, cache.segment_ids)
        k_positions = key_positions(segments, slots)
        h = self.embed(token_ids[:, None])
        new_layers: list[LayerCache] = []
        for block, layer in zip(self.layers, cache.layers, strict=True):
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, positions[:, None])
            out, *written = block.self_attn.decode_step(
                x, positions, *layer, k_positions, k.reshape(batch, -1), v.reshape(batch, -1), interpret=interpret)
            new_layers.append(LayerCache(*written))
            h = block.finish(h, out)
        return self._output(h, head)[:, 0], KVCache(tuple(new_layers), segments)


def flatten_cache(cache: KVCache) -> KVCache:
    """[B, S, K, D] keys and values -> the flat [B, S, K * D] cache ``Transformer.decode``
    runs the TPU kernels on."""
    return cache._replace(layers=tuple(
        LayerCache(*(x.reshape(*x.shape[:2], -1) for x in layer)) for layer in cache.layers
    ))


def init_model(
    config: TransformerConfig, seed: int, dtype: jnp.dtype = jnp.float32,
    placement: Callable[[tuple[int, ...]], jax.sharding.Sharding] | None = None,
) -> Transformer:
    """The random initialisation every component agrees on: the learner's version 0 and an actor's
    weights before its first fetch are the same arrays for the same seed.

    It runs as one compiled program, placed or not, so the values are the same either way (an
    eager init fuses differently and differs in the last bit). ``placement(shape)``: each
    parameter's sharding; each device then computes only its own shard (JAX's partitionable
    random bits), so no device ever holds the whole model. The seed's key is the program's
    argument, so it compiles once per (config, dtype, placement), not once per seed."""
    model: Transformer = init_module(Transformer, config, seed, dtype, placement)
    return model


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
