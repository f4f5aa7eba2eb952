"""Useful flops of the policy's work, counted from its shape: what MFU divides by (``stoker
bench`` and ``stoker plan``'s bounds, the sync loop's report). Recomputation (remat) and padding
are not useful work."""

from __future__ import annotations

from stoker.model.layers import head_dim
from stoker.spec import TransformerConfig


def matmul_params(config: TransformerConfig) -> int:
    """Parameters that take part in a matmul per token: every layer's projections and the head;
    in a mixture-of-experts layer the router and the k experts a token is routed to (the active
    parameters), never the experts it is not."""
    hd = head_dim(config)
    attention = config.hidden_size * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    dense = 3 * config.hidden_size * config.intermediate_size
    routed = config.num_experts_per_tok * 3 * config.hidden_size * config.expert_size + config.hidden_size * config.num_experts
    mlp = sum(routed if config.is_moe_layer(i) else dense for i in range(config.num_layers))
    return config.num_layers * attention + mlp + config.vocab_size * config.hidden_size


def train_flops(config: TransformerConfig, rows: int, length: int) -> float:
    """Useful flops of a forward and backward over [rows, length] tokens: 6 per matmul parameter
    per token, plus causal attention's 6 x layers x query width x length per token (half of the
    12 a full square of scores costs); remat's recomputation is not useful work."""
    tokens = rows * length
    attention = 6 * config.num_layers * config.num_heads * head_dim(config) * length
    return float(tokens * (6 * matmul_params(config) + attention))


def decode_flops(config: TransformerConfig, rows: int, context: int) -> float:
    """Useful flops of one decode step: 2 per matmul parameter per row, plus attention over
    ``context`` cached slots (scores and values: 4 x layers x query width x context)."""
    attention = 4 * config.num_layers * config.num_heads * head_dim(config) * context
    return float(rows * (2 * matmul_params(config) + attention))
