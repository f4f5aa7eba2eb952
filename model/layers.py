"""The transformer's layers: RMSNorm, grouped-query attention with rotary embeddings, the gated
MLP (or a mixture of experts, ``stoker.model.moe``) and the pre-norm block that holds them, each
under Hugging Face's names.

The equations, and what each ``TransformerConfig`` field changes for Gemma: ``stoker.model.model``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.model.attention import Visibility
from stoker.model.attention_kernels import Implementation, attend
from stoker.model.decode_attention import ragged_decode_attention, write_rows
from stoker.model.decode_fused import attend_and_write
from stoker.model.moe import RouterStats, SparseMoE
from stoker.model.rope import inverse_frequencies, rotary
from stoker.spec import TransformerConfig

# The most rows a decode step writes its cache inside the attention kernel (decode_fused) rather
# than in a kernel of its own before it: on a TPU v5e one kernel took 57.7 us a layer against 61.8
# at 128 rows, 85.5 against 74.5 at 256 (benchmarks/README.md, "The decode step's kernels").
WRITE_FUSED_MAX_ROWS = 128


def head_dim(config: TransformerConfig) -> int:
    """Per-head width: ``config.head_dim`` or ``hidden_size / num_heads``."""
    return config.head_dim if config.head_dim is not None else config.hidden_size // config.num_heads


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32:

    y = w * (x / sqrt(mean(x^2) + eps))        (Llama: the normed x is cast back first)
    y = (1 + w) * (x / sqrt(mean(x^2) + eps))  (Gemma, ``unit_offset``: w starts at 0).
    """

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype, unit_offset: bool = False):
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((size,), dtype=dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


def _linear(n_in: int, n_out: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


def norm_layer(config: TransformerConfig, size: int, dtype: jnp.dtype) -> RMSNorm:
    """An ``RMSNorm`` of width ``size`` as ``config`` has it (Gemma's unit offset or not)."""
    return RMSNorm(size, config.rms_norm_eps, dtype=dtype, unit_offset=config.norm_unit_offset)


class LayerCache(NamedTuple):
    """One layer's keys and values for every cache slot: [B, S, num_kv_heads, head_dim], or flat
    [B, S, num_kv_heads * head_dim] for the TPU decode kernels (``stoker.model.decode_attention``)."""

    keys: jax.Array
    values: jax.Array


class Attention(nnx.Module):
    """Grouped-query attention with rotary positions (``num_kv_heads`` key/value heads shared by
    ``num_heads`` query heads); a local layer attends only within ``config.sliding_window``."""

    def __init__(self, config: TransformerConfig, layer: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = head_dim(config)
        local = config.is_local_layer(layer)
        self.window = config.sliding_window if local else None
        if local:  # Gemma 3's local layers: their own base, never rescaled
            theta = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
            self.inv_freq = tuple(inverse_frequencies(self.head_dim, theta, None).tolist())
        else:
            freq = inverse_frequencies(self.head_dim, config.rope_theta, config.rope_scaling)
            self.inv_freq = tuple(freq.tolist())
        scalar = config.query_pre_attn_scalar if config.query_pre_attn_scalar is not None else self.head_dim
        self.scale = 1.0 / math.sqrt(scalar)
        self.softcap = config.attn_logit_softcap
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = _linear(hidden, self.num_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.k_proj = _linear(hidden, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.v_proj = _linear(hidden, self.num_kv_heads * self.head_dim, dtype=dtype, rngs=rngs, bias=bias)
        self.o_proj = _linear(self.num_heads * self.head_dim, hidden, dtype=dtype, rngs=rngs)
        # Qwen3 and Gemma 3 normalise each query/key head before the rotation.
        self.q_norm: RMSNorm | None = norm_layer(config, self.head_dim, dtype) if config.qk_norm else None
        self.k_norm: RMSNorm | None = norm_layer(config, self.head_dim, dtype) if config.qk_norm else None

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rotated keys and values for tokens ``x`` [B, T, hidden] at ``positions`` [B, T]."""
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rotary(k, positions, self.inv_freq), v

    def __call__(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, vis: Visibility,
        kernel: Implementation = "blockwise",
    ) -> jax.Array:
        """Attend from ``x`` [B, T, hidden] to ``keys``/``values`` [B, S, kv_heads, D] that ``vis``
        makes visible (a local layer only the last ``window`` of them). A ``kernel`` other than
        blockwise needs packed self-attention (``stoker.model.attention_kernels``)."""
        b, t, _ = x.shape
        q = self.queries(x, positions)
        out = attend(kernel, q, keys, values, vis, scale=self.scale, softcap=self.softcap, window=self.window)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotated queries [B, T, heads, D] for tokens ``x`` [B, T, hidden] at ``positions`` [B, T]."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return rotary(q, positions, self.inv_freq)

    def decode_step(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, k_positions: jax.Array,
        new_keys: jax.Array, new_values: jax.Array, *, interpret: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One query a row, ``x`` [B, 1, hidden] at ``positions`` [B], over a flat cache [B, S,
        kv_heads * D] whose slot positions are ``k_positions`` [B, S] (``decode_attention``),
        after writing each row's ``new_keys``/``new_values`` [B, kv_heads * D] into slot
        ``positions[b]``: (out, keys, values). Up to ``WRITE_FUSED_MAX_ROWS`` rows the write runs
        inside the attention kernel, past it in a kernel of its own."""
        b = x.shape[0]
        q = self.queries(x, positions[:, None])[:, 0]
        scale, softcap, window = self.scale, self.softcap, self.window
        if b <= WRITE_FUSED_MAX_ROWS:
            out, keys, values = attend_and_write(q, keys, values, new_keys, new_values, positions, k_positions,
                                                 scale=scale, softcap=softcap, window=window, interpret=interpret)
        else:
            keys, values = write_rows(keys, values, new_keys, new_values, positions, interpret=interpret)
            out = ragged_decode_attention(q, keys, values, positions, k_positions, scale=scale, softcap=softcap,
                                          window=window, interpret=interpret)
        return self.o_proj(out.reshape(b, 1, self.num_heads * self.head_dim)), keys, values


class MLP(nnx.Module):
    """The gated MLP, ``W_down (act(W_gate x) * W_up x)``: SwiGLU (silu), or GeGLU (gelu-tanh)."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gelu = config.mlp_activation == "gelu-tanh"
        self.gate_proj = _linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
        self.up_proj = _linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(act * self.up_proj(x))


class Block(nnx.Module):
    """One layer. Hugging Face's names: in a Llama block ``post_attention_layernorm`` is the norm
    before the MLP; in a Gemma block it normalises the attention output, and the MLP has its own
    ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``."""

    def __init__(self, config: TransformerConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, layer: int = 0):
        hidden = config.hidden_size
        self.input_layernorm = norm_layer(config, hidden, dtype)
        self.self_attn = Attention(config, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm_layer(config, hidden, dtype)
        self.pre_feedforward_layernorm: RMSNorm | None = norm_layer(config, hidden, dtype) if config.sandwich_norms else None
        self.post_feedforward_layernorm: RMSNorm | None = norm_layer(config, hidden, dtype) if config.sandwich_norms else None
        # A mixture-of-experts layer (``stoker.model.moe``) keeps Hugging Face's name for its MLP.
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, dtype=dtype, rngs=rngs) if config.is_moe_layer(layer) else MLP(config, dtype=dtype, rngs=rngs)
        )

    def finish(self, h: jax.Array, attended: jax.Array) -> jax.Array:
        """The residual stream after this layer, given its attention output."""
        return self._finish(h, attended, None)[0]

    def _feed_forward(self, x: jax.Array, valid: jax.Array | None) -> tuple[jax.Array, RouterStats | None]:
        if valid is not None and isinstance(self.mlp, SparseMoE):
            return self.mlp.with_stats(x, valid)
        return self.mlp(x), None

    def _finish(
        self, h: jax.Array, attended: jax.Array, valid: jax.Array | None
    ) -> tuple[jax.Array, RouterStats | None]:
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            h = h + attended
            out, stats = self._feed_forward(self.post_attention_layernorm(h), valid)
            return h + out, stats
        h = h + self.post_attention_layernorm(attended)
        out, stats = self._feed_forward(self.pre_feedforward_layernorm(h), valid)
        return h + self.post_feedforward_layernorm(out), stats

    def routed(
        self, h: jax.Array, positions: jax.Array, vis: Visibility, valid: jax.Array, kernel: Implementation = "blockwise"
    ) -> tuple[jax.Array, RouterStats | None]:
        """The training forward (self-attention over the tokens themselves), with a sparse layer's
        routing sums over the ``valid`` tokens (None for a dense layer)."""
        x = self.input_layernorm(h)
        k, v = self.self_attn.project_kv(x, positions)
        return self._finish(h, self.self_attn(x, positions, k, v, vis, kernel), valid)

    def __call__(
        self, h: jax.Array, positions: jax.Array, vis: Visibility, kernel: Implementation = "blockwise"
    ) -> tuple[jax.Array, LayerCache]:
        """Self-attention over the tokens themselves (training, prefill): new h and their k/v."""
        x = self.input_layernorm(h)
        k, v = self.self_attn.project_kv(x, positions)
        return self.finish(h, self.self_attn(x, positions, k, v, vis, kernel)), LayerCache(k, v)
