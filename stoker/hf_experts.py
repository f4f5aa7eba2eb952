"""How Hugging Face checkpoints describe mixture-of-experts layers (Qwen3-MoE, Mixtral): the
config.json keys and their defaults, the per-expert tensor names, and which family a
``TransformerConfig`` with experts exports as (``stoker.model.moe`` computes the layers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic.alias_generators import to_camel

from stoker.checkpoint_error import CheckpointError
from stoker.spec import TransformerConfig

# Mixture-of-experts keys (``stoker.model.moe``), with transformers' defaults for those left out.
MOE_KEYS = {
    "qwen3_moe": frozenset({
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
    }),
    "mixtral": frozenset({"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "output_router_logits"}),
}
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
        "mlp_only_layers": None, "router_aux_loss_coef": 0.001, "output_router_logits": False,
    },
    "mixtral": {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "output_router_logits": False},
}
# Mixtral's names for an expert's projections (w1 gate, w3 up, w2 down) and for a layer's MoE block.
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
MIXTRAL_BLOCK = "block_sparse_moe"
# What only Gemma's decoders set (besides sandwichNorms): a config with any of them is Gemma 2/3.
GEMMA_ONLY = ("mlp_activation", "norm_unit_offset", "embedding_scale", "query_pre_attn_scalar", "attn_logit_softcap",
              "final_logit_softcap", "sliding_window", "rope_local_theta")


def non_default(config: TransformerConfig, fields: tuple[str, ...]) -> list[str]:
    """Which of ``fields`` the config sets to other than TransformerConfig's default."""
    return [f for f in fields if getattr(config, f) != TransformerConfig.model_fields[f].default]


def moe_settings(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The ``TransformerConfig`` mixture-of-experts fields of a qwen3_moe or mixtral config.json.

    Qwen3-MoE: layer i is sparse iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0; its experts are moe_intermediate_size wide, its dense layers intermediate_size.
    Mixtral: every layer sparse, experts intermediate_size wide, top-k weights always renormalised."""
    hf = {**MOE_DEFAULTS[model_type], **hf}
    experts = hf.get("num_local_experts")
    if model_type == "qwen3_moe":  # transformers 5 aliases num_experts to num_local_experts
        named = hf.get("num_experts")
        if experts is not None and named is not None and experts != named:
            raise CheckpointError(f"num_experts {named!r} disagrees with num_local_experts {experts!r}")
        experts = named if named is not None else experts if experts is not None else 128
    elif experts is None:
        experts = 8
    out: dict[str, Any] = {
        "num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"],
        "router_aux_loss_coef": hf["router_aux_loss_coef"], "output_router_logits": hf["output_router_logits"],
    }
    if model_type == "qwen3_moe":
        out |= {
            "moe_intermediate_size": hf["moe_intermediate_size"], "norm_topk_prob": hf["norm_topk_prob"],
            "decoder_sparse_step": hf["decoder_sparse_step"], "mlp_only_layers": tuple(hf["mlp_only_layers"] or ()),
        }
    return out


def uses_mixtral_names(config: TransformerConfig) -> bool:
    """Whether a checkpoint of this architecture names its experts as Mixtral does (a mixture of
    experts without Qwen3's q/k norms)."""
    return config.num_experts > 0 and not config.qk_norm


def expert_weight_name(layer: int, expert: int, projection: str, mixtral: bool) -> str:
    """The checkpoint name of one expert's projection (``gate_proj``, ``up_proj`` or ``down_proj``)."""
    if mixtral:
        return f"model.layers.{layer}.{MIXTRAL_BLOCK}.experts.{expert}.{MIXTRAL_EXPERT_NAMES[projection]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def router_weight_name(layer: int, mixtral: bool) -> str:
    """The checkpoint name of a sparse layer's router (Hugging Face's ``gate``)."""
    return f"model.layers.{layer}.{MIXTRAL_BLOCK if mixtral else 'mlp'}.gate.weight"


def moe_type_of(config: TransformerConfig) -> str:
    """qwen3_moe (q/k norms) or mixtral; a mixture of experts neither describes is refused."""
    odd = non_default(config, ("sandwich_norms", *GEMMA_ONLY))
    if odd:
        raise CheckpointError(f"no Hugging Face family has mixture-of-experts layers with {', '.join(map(to_camel, odd))}")
    if config.qk_norm:
        return "qwen3_moe"
    mixtral = {
        "normTopkProb": config.norm_topk_prob, "decoderSparseStep": config.decoder_sparse_step == 1,
        "mlpOnlyLayers": not config.mlp_only_layers, "attentionBias": not config.attention_bias,
        "moeIntermediateSize": config.expert_size == config.intermediate_size,
    }
    if not all(mixtral.values()):
        wrong = ", ".join(name for name, ok in mixtral.items() if not ok)
        raise CheckpointError(
            f"a mixture of experts without qkNorm is Mixtral, which has none of {wrong} as configured "
            "(Mixtral: normTopkProb true, every layer sparse, experts intermediateSize wide, no attention bias)"
        )
    return "mixtral"


def moe_to_hf(config: TransformerConfig, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts keys of a qwen3_moe or mixtral config.json."""
    out: dict[str, Any] = {
        "num_experts_per_tok": config.num_experts_per_tok, "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": config.output_router_logits,
    }
    if model_type == "mixtral":
        return out | {"num_local_experts": config.num_experts, "sliding_window": None}
    return out | {
        "num_experts": config.num_experts, "moe_intermediate_size": config.expert_size,
        "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers), "use_sliding_window": False,
    }
