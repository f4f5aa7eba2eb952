"""A Hugging Face ``config.json`` <-> ``TransformerConfig``, without JAX (``stoker validate`` reads it).

The checkpoint's config.json is the source of truth for the architecture: ``resolve_architecture``
replaces ``spec.model.architecture`` with what the checkpoint says, and reports every field the
manifest also gives with a different value.

Both formats real checkpoints come in are read: transformers 4's top-level ``rope_theta`` with an
optional ``rope_scaling``, and transformers 5's ``rope_parameters`` (for Gemma 3, one per layer
type). Every key is either understood, known not to change the forward pass, or refused: a
checkpoint is never loaded as something it is not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from stoker.checkpoint_error import CheckpointError
from stoker.hf_experts import GEMMA_ONLY, MOE_KEYS, moe_settings, moe_to_hf, moe_type_of, non_default
from stoker.spec import RLJobSpec, RopeScaling, TransformerConfig

CONFIG_FILE = "config.json"

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")
GEMMA_TYPES = ("gemma2", "gemma3_text")
MOE_TYPES = ("qwen3_moe", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")

# Keys that never change the forward pass (bookkeeping, generation defaults, training-only knobs
# that are off). Keys starting with "_" and ending in "_token_id"/"_version" are skipped too.
_INERT_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "initializer_range", "use_cache",
    "cache_implementation", "output_attentions", "output_hidden_states", "return_dict",
    "max_window_layers", "sliding_window_size", "tie_word_embeddings",
})
# Keys whose only value the model supports is the one given (anything else is refused).
_REQUIRED_VALUES: dict[str, Any] = {
    "attention_dropout": 0.0, "pretraining_tp": 1, "mlp_bias": False, "use_mrope": False,
    "use_bidirectional_attention": False, "use_sliding_window": False, "router_jitter_noise": 0.0,
}
# Keys read into TransformerConfig (per family below).
_COMMON_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "layer_types",
})
_GEMMA_KEYS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "sliding_window", "layer_types", "sliding_window_pattern", "rope_local_base_freq",
})
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    "sliding_window": 4096,
}
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "sliding_window": 4096, "rope_theta": 1_000_000.0,
}
_ROPE_SCALING_KEYS = {
    "default": {"rope_theta"},
    "linear": {"rope_theta", "factor"},
    "llama3": {"rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


# ----------------------------------------------------------------------------------- rope


def _rope(params: Mapping[str, Any], where: str) -> tuple[float | None, RopeScaling | None]:
    """(theta, scaling) from one rope dict (``rope_parameters`` or a legacy ``rope_scaling``)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{where}: rope_type {rope_type!r} is not supported; expected one of {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    unknown = sorted(set(params) - _ROPE_SCALING_KEYS[rope_type] - {"rope_type", "type"})
    if unknown:
        raise CheckpointError(f"{where}: {', '.join(unknown)} not understood for rope_type {rope_type!r}")
    theta = params.get("rope_theta")
    if rope_type == "default":
        return theta, None
    if "factor" not in params:
        raise CheckpointError(f"{where}: rope_type {rope_type!r} needs a factor")
    fields = {k: params[k] for k in _ROPE_SCALING_KEYS[rope_type] if k in params and k != "rope_theta"}
    try:
        return theta, RopeScaling(type=rope_type, **fields)
    except ValidationError as err:
        raise CheckpointError(f"{where}: {err.errors()[0]['msg']}") from err


def _rope_settings(hf: Mapping[str, Any], gemma3: bool) -> dict[str, Any]:
    """rope_theta, rope_scaling (and rope_local_theta for Gemma 3) from either config format."""
    legacy_theta = hf.get("rope_theta")
    legacy_scaling = _rope(hf["rope_scaling"], "rope_scaling") if hf.get("rope_scaling") else (None, None)
    params = hf.get("rope_parameters")
    local_theta = hf.get("rope_local_base_freq")
    if params:
        if not isinstance(params, Mapping):
            raise CheckpointError(f"rope_parameters: got {params!r}; expected a mapping")
        if "full_attention" in params or "sliding_attention" in params:
            unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
            if unknown:
                raise CheckpointError(f"rope_parameters: layer types {unknown} not understood")
            theta, scaling = _rope(params.get("full_attention", {}), "rope_parameters.full_attention")
            if "sliding_attention" in params:
                local, local_scaling = _rope(params["sliding_attention"], "rope_parameters.sliding_attention")
                if local_scaling is not None:
                    raise CheckpointError("rope_parameters.sliding_attention: rope scaling on local layers is not supported")
                local_theta = local if local is not None else local_theta
        else:
            theta, scaling = _rope(params, "rope_parameters")
        for name, legacy, new in (("rope_theta", legacy_theta, theta), ("rope_scaling", legacy_scaling[1], scaling)):
            if legacy is not None and new is not None and legacy != new:
                raise CheckpointError(f"{name} {legacy!r} disagrees with rope_parameters ({new!r})")
    else:
        theta, scaling = legacy_theta, legacy_scaling[1]
    out: dict[str, Any] = {"rope_theta": float(theta if theta is not None else 10000.0), "rope_scaling": scaling}
    if gemma3:
        out["rope_local_theta"] = float(local_theta if local_theta is not None else 10000.0)
    elif local_theta is not None:
        raise CheckpointError("rope_local_base_freq is only understood for gemma3_text")
    return out


# --------------------------------------------------------------------------------- config


def _global_layer_every(hf: Mapping[str, Any], default: int) -> int:
    """Gemma's local/global layout as one period p (layer i global iff (i + 1) % p == 0)."""
    layers = int(hf["num_hidden_layers"])
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
    types = hf.get("layer_types")
    if types is None:
        return int(pattern or default)
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"layer_types: expected {layers} of full_attention / sliding_attention, got {types!r}")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    period = full[0] + 1 if full else int(pattern or layers + 1)
    if any((t == "full_attention") != ((i + 1) % period == 0) for i, t in enumerate(types)):
        raise CheckpointError(f"layer_types {types!r}: only every-nth-layer-global layouts are supported")
    return period


def _check_full_attention(hf: Mapping[str, Any]) -> None:
    """transformers 5 writes ``layer_types`` for every family; without a sliding window (Llama,
    Qwen with use_sliding_window false, Mistral without one) every layer must be full_attention."""
    types = hf.get("layer_types")
    if types is None:
        return
    layers = hf.get("num_hidden_layers")
    if not isinstance(types, list) or len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise CheckpointError(f"layer_types: expected {layers} of full_attention / sliding_attention, got {types!r}")
    local = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if local:
        raise CheckpointError(
            f"layer_types: layers {local[:4]}{'...' if len(local) > 4 else ''} are sliding_attention; "
            f"sliding-window attention is supported for Gemma only, not {hf.get('model_type')}"
        )


def _check_keys(hf: Mapping[str, Any], known: frozenset[str]) -> None:
    for key, required in _REQUIRED_VALUES.items():
        if key in hf and hf[key] not in (required, None):
            raise CheckpointError(f"{key} {hf[key]!r} is not supported; expected {required!r}")
    unknown = sorted(
        k for k in hf
        if k not in known and k not in _INERT_KEYS and k not in _REQUIRED_VALUES
        and not k.startswith("_") and not k.endswith(("_token_id", "_version"))
    )
    if unknown:
        raise CheckpointError(
            f"config.json field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} not understood for "
            f"model_type {hf.get('model_type')!r}; refusing to guess what {'they change' if len(unknown) > 1 else 'it changes'}"
        )


def config_from_hf(hf: Mapping[str, Any]) -> TransformerConfig:
    """``TransformerConfig`` from a Hugging Face ``config.json`` dict (either format)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = " (a multimodal Gemma 3; give its text model, gemma3_text)" if model_type == "gemma3" else ""
        raise CheckpointError(
            f"model_type {model_type!r} is not supported{hint}; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    gemma = model_type in GEMMA_TYPES
    if gemma:  # transformers' defaults for keys a config.json leaves out
        hf = {**(_GEMMA2_DEFAULTS if model_type == "gemma2" else _GEMMA3_DEFAULTS), **hf}
    known = _COMMON_KEYS | _GEMMA_KEYS if gemma else _COMMON_KEYS | {"sliding_window"}
    _check_keys(hf, known | MOE_KEYS.get(model_type, frozenset()))
    if model_type in ("mistral", "mixtral") and hf.get("sliding_window") is not None:
        raise CheckpointError(f"sliding-window attention is supported for Gemma only, not {model_type}")
    if not gemma:
        _check_full_attention(hf)
    if gemma:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise CheckpointError(f"hidden_activation {act!r} is not supported for {model_type}; expected gelu_pytorch_tanh")
    elif hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported; expected silu")
    explicit_head_dim = hf.get("head_dim")
    heads, hidden = hf.get("num_attention_heads", 0), hf.get("hidden_size", 0)
    if heads and explicit_head_dim == hidden // heads and hidden % heads == 0:
        explicit_head_dim = None  # the default; keeps config round trips equal
    try:
        fields: dict[str, Any] = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=explicit_head_dim,
            intermediate_size=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", gemma),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            **_rope_settings(hf, gemma3=model_type == "gemma3_text"),
        )
        if model_type in MOE_TYPES:
            fields |= moe_settings(hf, model_type)
        if gemma:
            fields |= dict(
                mlp_activation="gelu-tanh",
                norm_unit_offset=True,
                sandwich_norms=True,
                embedding_scale=True,
                query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
                attn_logit_softcap=hf.get("attn_logit_softcapping"),
                final_logit_softcap=hf.get("final_logit_softcapping"),
                sliding_window=hf.get("sliding_window"),
            )
            if fields["sliding_window"] is not None:
                fields["global_layer_every"] = _global_layer_every(hf, 2 if model_type == "gemma2" else 6)
        return TransformerConfig(**fields)
    except KeyError as err:
        raise CheckpointError(f"config.json lacks {err.args[0]!r}") from err
    except ValidationError as err:
        first = err.errors()[0]
        raise CheckpointError(f"config.json: {'.'.join(map(str, first['loc']))}: {first['msg']}") from err


def model_type_of(config: TransformerConfig) -> str:
    """The Hugging Face family a config belongs to (the inverse of ``config_from_hf``)."""
    if config.num_experts:
        return moe_type_of(config)
    if config.sandwich_norms:
        return "gemma3_text" if config.qk_norm else "gemma2"
    odd = non_default(config, GEMMA_ONLY)
    if odd:
        raise CheckpointError(f"no Hugging Face family has {', '.join(map(to_camel, odd))} without sandwichNorms")
    if config.qk_norm:
        return "qwen3"
    return "qwen2" if config.attention_bias else "llama"


_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
}


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    out: dict[str, Any] = {"rope_type": scaling.type, "rope_theta": theta, "factor": scaling.factor}
    if scaling.type == "llama3":
        out |= {
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return out


def config_to_hf(config: TransformerConfig, dtype: str = "float32") -> dict[str, Any]:
    """A ``config.json`` dict that transformers 4 and 5 (and ``config_from_hf``) read alike: the rope
    settings are written in both formats (top-level ``rope_theta``/``rope_scaling``, which
    transformers 4 reads, and ``rope_parameters``, which transformers 5 writes)."""
    model_type = model_type_of(config)
    heads_dim = config.head_dim if config.head_dim is not None else config.hidden_size // config.num_heads
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": heads_dim,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else _rope_dict(config.rope_theta, config.rope_scaling),
    }
    if model_type in ("llama", "qwen3", "gemma2", "gemma3_text", "qwen3_moe"):
        hf["attention_bias"] = config.attention_bias
    if model_type in MOE_TYPES:
        hf |= moe_to_hf(config, model_type)
    if model_type not in GEMMA_TYPES:
        hf["hidden_act"] = "silu"
        hf["rope_parameters"] = _rope_dict(config.rope_theta, config.rope_scaling)
        return hf
    hf |= {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config.query_pre_attn_scalar if config.query_pre_attn_scalar is not None else heads_dim,
        "attn_logit_softcapping": config.attn_logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap,
        "sliding_window": config.sliding_window,
    }
    if config.global_layer_every is not None:
        hf["layer_types"] = [
            "sliding_attention" if config.is_local_layer(i) else "full_attention" for i in range(config.num_layers)
        ]
    if model_type == "gemma3_text":
        local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
        hf["rope_local_base_freq"] = local
        if config.global_layer_every is not None:
            hf["sliding_window_pattern"] = config.global_layer_every
        hf["rope_parameters"] = {
            "full_attention": _rope_dict(config.rope_theta, config.rope_scaling),
            "sliding_attention": _rope_dict(local, None),
        }
    else:
        hf["rope_parameters"] = _rope_dict(config.rope_theta, config.rope_scaling)
    return hf


# ------------------------------------------------------------------------------ checkpoints


def read_config(directory: str | Path) -> TransformerConfig:
    """The architecture of a Hugging Face-format checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} not found; a checkpoint directory needs config.json") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config_from_hf(hf)


def _disagreements(given: Any, truth: Any, prefix: str) -> list[tuple[str, str]]:
    """Fields set explicitly in ``given`` (recursively) whose value differs from ``truth``."""
    out: list[tuple[str, str]] = []
    for name in sorted(given.model_fields_set):
        mine, theirs = getattr(given, name), getattr(truth, name)
        path = f"{prefix}.{to_camel(name)}"
        if isinstance(mine, RopeScaling) and isinstance(theirs, RopeScaling):
            out += _disagreements(mine, theirs, path)
        elif mine != theirs:
            shown = theirs.model_dump(by_alias=True) if isinstance(theirs, RopeScaling) else theirs
            mine_shown = mine.model_dump(by_alias=True) if isinstance(mine, RopeScaling) else mine
            out.append((path, f"got {mine_shown!r}; the checkpoint's config.json says {shown!r}"))
    return out


def resolve_architecture(spec: RLJobSpec) -> tuple[RLJobSpec, list[tuple[str, str]]]:
    """``spec`` with ``model.architecture`` read from a local ``model.checkpoint``, and the problems
    as ``(field path under spec, message)``. A checkpoint path that is not a local directory (a
    bucket, a path that exists only in the cluster) leaves the spec as it is."""
    checkpoint = spec.model.checkpoint
    if not checkpoint or not Path(checkpoint).expanduser().is_dir():
        return spec, []
    try:
        truth = read_config(Path(checkpoint).expanduser())
    except CheckpointError as err:
        return spec, [("model.checkpoint", str(err))]
    problems = []
    if "architecture" in spec.model.model_fields_set:
        problems = _disagreements(spec.model.architecture, truth, "model.architecture")
    model = spec.model.model_copy(update={"architecture": truth})
    return spec.model_copy(update={"model": model}), problems
