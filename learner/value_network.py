"""PPO's critic (``ValueNetwork``) and its initialisation, placed on the mesh as the policy is."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stoker.model.layers import Block, RMSNorm
from stoker.model.model import init_module, packed_visibility
from stoker.spec import TransformerConfig


class ValueNetwork(nnx.Module):
    """PPO's critic: a separate one-block transformer with a scalar head, V(prefix up to t).

    Kept apart from the policy (rather than a head on its last hidden state) so the policy stays
    exactly the published Llama/Qwen graph the actors load; one block of the policy's width is
    enough to read the state of a packed row and costs ~1/num_layers of the policy's compute.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.block = Block(config, dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.head = nnx.Linear(
            config.hidden_size, 1, dtype=dtype, param_dtype=dtype, kernel_init=nnx.initializers.zeros_init(), rngs=rngs
        )

    def __call__(self, token_ids: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """[B, T] int32 x3 -> float32 values [B, T]."""
        h, _ = self.block(self.embed_tokens(token_ids), positions, packed_visibility(segment_ids))
        return self.head(self.norm(h))[..., 0].astype(jnp.float32)


def init_value_network(
    config: TransformerConfig, seed: int, dtype: Any = jnp.float32, placement: Any = None
) -> ValueNetwork:
    """PPO's critic, initialised as ``init_model`` initialises the policy: one compiled program,
    placed or not (the same values either way); ``placement(shape)`` is each parameter's
    sharding, so each device computes only its own shard; compiled once per (config, dtype,
    placement), the seed's key being the program's argument."""
    network: ValueNetwork = init_module(ValueNetwork, config, seed, dtype, placement)
    return network
