"""The policy: a decoder-only transformer of the Llama/Qwen family, in Flax NNX.

One implementation serves the learner (packed training forward) and the actors' sampler (prefill
plus KV-cached decode, see ``stoker.learner.sampling``). Submodules carry Hugging Face's names
(``embed_tokens``, ``layers.N.self_attn.q_proj`` ...) so the checkpoint mapping in
``stoker.learner.hf`` is a rename plus a transpose, nothing more.

Each block is the pre-norm residual pair

    h = x + Attn(RMSNorm(x)),        y = h + MLP(RMSNorm(h)),
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps),
    MLP(x) = W_down (silu(W_gate x) * W_up x)                       (SwiGLU),

with rotary position embeddings on queries and keys and grouped-query attention (each key/value
head serves ``num_heads / num_kv_heads`` query heads).

Packed rows: ``segment_ids`` label which sequence each token belongs to (0 = padding). A query
attends to key j only if both share the same nonzero segment and j is not after it, so sequences
packed side by side never see each other; ``positions`` restart at 0 for each sequence.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.spec import TransformerConfig

# Hugging Face's ``initializer_range``: small embeddings keep the initial policy near uniform,
# which is what exploration in RL wants when the head is tied to the embedding.
EMBED_INIT_STDDEV = 0.02
# Added to masked attention scores; finite so fully-masked (padding) rows stay NaN-free.
_MASKED = -1e30


def head_dim(config: TransformerConfig) -> int:
    """Per-head width: ``config.head_dim`` or ``hidden_size / num_heads``."""
    return config.head_dim if config.head_dim is not None else config.hidden_size // config.num_heads


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's ``LlamaRMSNorm``:

    y = w * (x / sqrt(mean(x^2) + eps)).
    """

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((size,), dtype=dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in Hugging Face's "rotate half" layout.

    For a head vector split into halves (x1, x2) and frequencies f_i = theta^(-2i/d):

        rope(x, p) = (x1 cos(p f) - x2 sin(p f),  x2 cos(p f) + x1 sin(p f)).

    ``x`` is [B, T, H, D]; ``positions`` is [B, T].
    """
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : dim // 2], x32[..., dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(n_in: int, n_out: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class LayerCache(NamedTuple):
    """One layer's keys and values for every cache slot: [B, S, num_kv_heads, head_dim]."""

    keys: jax.Array
    values: jax.Array


class KVCache(NamedTuple):
    """The sampler's cache. Slot s of row b holds the token at position s of that row's sequence;
    ``segment_ids[b, s]`` is nonzero once the slot holds a real token."""

    layers: tuple[LayerCache, ...]
    segment_ids: jax.Array  # [B, S] int32


class Attention(nnx.Module):
    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = head_dim(config)
        self.rope_theta = config.rope_theta
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = _linear(hidden, self.num_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.k_proj = _linear(hidden, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.v_proj = _linear(hidden, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.o_proj = _linear(self.num_heads * self.head_dim, hidden, dtype=dtype, rngs=rngs)
        # Qwen3 normalises each query/key head before the rotation.
        eps = config.rms_norm_eps
        self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, eps, dtype=dtype) if config.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, eps, dtype=dtype) if config.qk_norm else None

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotated keys and values for tokens ``x`` [B, T, hidden] at ``positions`` [B, T]."""
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rotary(k, positions, self.rope_theta), v

    def __call__(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array
    ) -> jax.Array:
        """Attend from ``x`` [B, T, hidden] to ``keys``/``values`` [B, S, kv_heads, D] where
        ``mask`` [B, T, S] is true. Scores are softmax(q k^T / sqrt(D)) in float32."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = rotary(q, positions, self.rope_theta)
        out = jax.nn.dot_product_attention(q, keys, values, mask=mask[:, None, :, :], implementation="xla")
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)


def packed_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] mask: query t sees key s iff s <= t and both lie in the same nonzero segment."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same & (segment_ids != 0)[:, :, None]


class Transformer(nnx.Module):
    """Decoder-only Llama/Qwen-style language model sized by ``TransformerConfig``."""

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
        self.layers = nnx.List([Block(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
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

    def _logits(self, h: jax.Array) -> jax.Array:
        h = self.norm(h)
        if self.lm_head is None:
            table = self.embed_tokens.embedding[...]
            return jnp.einsum("btd,vd->btv", h, table, preferred_element_type=jnp.float32)
        kernel = self.lm_head.kernel[...]
        return jnp.einsum("btd,dv->btv", h, kernel, preferred_element_type=jnp.float32)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """Training forward over packed rows: int32 [B, T] x3 -> float32 logits [B, T, V].

        ``logits[b, t]`` predicts the token after ``token_ids[b, t]``."""
        logits, _ = self.prefill(token_ids, positions, segment_ids, cache_len=None)
        return logits

    def prefill(
        self,
        token_ids: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        cache_len: int | None,
        logits_at: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Forward over [B, T] tokens; with ``cache_len`` (>= T) also return a KV cache whose
        first T slots hold these tokens' keys and values (the sampler's prefill).

        ``logits_at`` [B]: return logits [B, V] at just that index of each row (the head is then
        applied to B vectors instead of B * T)."""
        mask = packed_mask(segment_ids)
        h = self.embed_tokens(token_ids)
        layer_caches: list[LayerCache] = []
        for block in self.layers:
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, positions)
            h = h + block.self_attn(x, positions, k, v, mask)
            h = h + block.mlp(block.post_attention_layernorm(h))
            if cache_len is not None:
                pad = ((0, 0), (0, cache_len - k.shape[1]), (0, 0), (0, 0))
                layer_caches.append(LayerCache(jnp.pad(k, pad), jnp.pad(v, pad)))
        if logits_at is not None:
            logits = self._logits(jnp.take_along_axis(h, logits_at[:, None, None], axis=1))[:, 0]
        else:
            logits = self._logits(h)
        if cache_len is None:
            return logits, None
        segments = jnp.pad(segment_ids, ((0, 0), (0, cache_len - segment_ids.shape[1])))
        return logits, KVCache(tuple(layer_caches), segments)

    def extend(
        self, token_ids: jax.Array, positions: jax.Array, valid: jax.Array, cache: KVCache, *, logits_at: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Append a chunk of tokens to cached sequences (the sampler's prefill when a
        conversation's earlier turns are already cached).

        ``token_ids``, ``positions`` and ``valid`` are [B, C]: row b's chunk continues its cached
        sequence at slots ``positions[b]`` (consecutive, starting where the cached prefix ends);
        invalid entries (chunk padding) are computed but never written. Each token attends to
        every slot up to its own position, i.e. the cached prefix and the chunk before it.
        Returns logits [B, V] at chunk index ``logits_at[b]`` and the cache with the chunk's
        keys and values written."""
        batch, num_slots = cache.segment_ids.shape
        slots = jnp.arange(num_slots)
        rows = jnp.arange(batch)[:, None]
        write = jnp.where(valid, positions, num_slots)  # out of range: dropped by the scatter
        filled = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)
        mask = slots[None, None, :] <= positions[:, :, None]  # [B, C, S]
        h = self.embed_tokens(token_ids)
        new_layers: list[LayerCache] = []
        for block, layer in zip(self.layers, cache.layers, strict=True):
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, positions)
            keys = layer.keys.at[rows, write].set(k, mode="drop")
            values = layer.values.at[rows, write].set(v, mode="drop")
            new_layers.append(LayerCache(keys, values))
            h = h + block.self_attn(x, positions, keys, values, mask)
            h = h + block.mlp(block.post_attention_layernorm(h))
        logits = self._logits(jnp.take_along_axis(h, logits_at[:, None, None], axis=1))[:, 0]
        segments = (slots[None, :] < filled[:, None]).astype(jnp.int32)
        return logits, KVCache(tuple(new_layers), segments)

    def decode(self, token_ids: jax.Array, positions: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """One cached step: token [B] at position [B] (= its cache slot) -> logits [B, V].

        Writes the token's keys/values into slot ``positions[b]`` of row b, then attends over the
        filled slots up to and including it."""
        num_slots = cache.segment_ids.shape[1]
        slots = jnp.arange(num_slots)
        write = slots[None, :] == positions[:, None]  # [B, S] one-hot of the slot to fill
        segments = jnp.where(write, 1, cache.segment_ids)
        mask = ((segments != 0) & (slots[None, :] <= positions[:, None]))[:, None, :]  # [B, 1, S]
        pos = positions[:, None]
        h = self.embed_tokens(token_ids[:, None])
        new_layers: list[LayerCache] = []
        for block, layer in zip(self.layers, cache.layers, strict=True):
            x = block.input_layernorm(h)
            k, v = block.self_attn.project_kv(x, pos)  # [B, 1, kv, D]
            keys = jnp.where(write[:, :, None, None], k, layer.keys)
            values = jnp.where(write[:, :, None, None], v, layer.values)
            new_layers.append(LayerCache(keys, values))
            h = h + block.self_attn(x, pos, keys, values, mask)
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self._logits(h)[:, 0], KVCache(tuple(new_layers), segments)


def init_model(config: TransformerConfig, seed: int, dtype: jnp.dtype = jnp.float32) -> Transformer:
    """The random initialisation every component agrees on: the learner's version 0 and an actor's
    weights before its first fetch are the same arrays for the same seed."""
    return Transformer(config, rngs=nnx.Rngs(params=seed), dtype=dtype)


def restrict_logits(logits: jax.Array, allowed_token_ids: tuple[int, ...] | None) -> jax.Array:
    """Logits with every token outside ``allowed_token_ids`` made impossible (constrained decoding).

    The sampler and the trainer both call this, so the distribution tokens are sampled from and
    the one the trainer scores them under are the same. ``None`` allows every token."""
    if allowed_token_ids is None:
        return logits
    allowed = jnp.zeros((logits.shape[-1],), jnp.bool_).at[jnp.asarray(allowed_token_ids)].set(True)
    # A large finite value rather than -inf keeps softmax and its gradient free of NaNs.
    return jnp.where(allowed, logits, jnp.asarray(-1e9, logits.dtype))


def token_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature) gathered at ``targets``: [B, T, V], [B, T] -> [B, T] float32.

    log p(y) = z_y / tau - logsumexp(z / tau). ``targets`` are the next tokens, so the usual call is
    ``token_logprobs(logits[:, :-1], token_ids[:, 1:])``. With the sampler's temperature this is
    exactly what the sampler recorded for the same ids (see ``stoker.learner.sampling``)."""
    z = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def token_log_not_taken(logits: jax.Array, targets: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """log(1 - p(y)) for the ``targets`` y, from the logits: [B, T, V], [B, T] -> [B, T] float32.

    Computed as logsumexp over the other tokens minus logsumexp over all, which stays exact (and
    its gradient finite) when p(y) rounds to 1 in float32 -- where ``log(-expm1(log p))`` is -inf.
    """
    z = logits.astype(jnp.float32) / temperature
    taken = jax.nn.one_hot(targets, z.shape[-1], dtype=jnp.bool_)
    # A large finite value rather than -inf keeps logsumexp's gradient free of NaNs.
    others = jax.nn.logsumexp(jnp.where(taken, jnp.asarray(-1e30, jnp.float32), z), axis=-1)
    return others - jax.nn.logsumexp(z, axis=-1)


def sequence_logprobs(
    logits: jax.Array, token_ids: jax.Array, segment_ids: jax.Array, *, temperature: float = 1.0
) -> jax.Array:
    """Log-probs aligned with the tokens, as trajectories store them: [B, T] float32 with

    out[b, t] = log p(token_ids[b, t] | earlier tokens of its segment)

    and 0 where token t opens a segment (nothing predicts it) or is padding."""
    lp = token_logprobs(logits[:, :-1], token_ids[:, 1:], temperature=temperature)
    continues = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    lp = jnp.where(continues, lp, 0.0)
    return jnp.pad(lp, ((0, 0), (1, 0)))


def count_params(model: nnx.Module) -> int:
    """Number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
