"""Every supported family from its config.json alone, in both config formats, against an
independent float64 forward written from the published architectures (Llama 3.1's rope scaling,
Qwen2/3, Gemma 2 arXiv:2408.00118, Gemma 3 arXiv:2503.19786), jit and eager."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from stoker.model.hf import CheckpointError, config_from_hf, load_checkpoint, to_hf
from stoker.model.model import Transformer, init_model

BASE: dict[str, Any] = {
    "vocab_size": 48, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 40, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
}
# transformers 4's format: top-level rope_theta and rope_scaling.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama3.1": BASE | {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_theta": 500000.0, "head_dim": 8, "mlp_bias": False, "attention_bias": False, "bos_token_id": 1,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    "qwen2.5": BASE | {
        "model_type": "qwen2", "hidden_act": "silu", "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21, "rope_scaling": None,
    },
    "qwen3": BASE | {
        "model_type": "qwen3", "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "head_dim": 12, "attention_bias": False,
    },
    "gemma2": BASE | {
        "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "head_dim": 16, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
        "sliding_window": 4, "rope_theta": 10000.0, "cache_implementation": "hybrid", "attention_bias": False,
        "num_hidden_layers": 2,
    },
    "gemma3": BASE | {
        "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "head_dim": 16,
        "query_pre_attn_scalar": 16, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "sliding_window": 4, "rope_theta": 1000000.0, "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "use_bidirectional_attention": False,
    },
}


def transformers5(hf: dict[str, Any]) -> dict[str, Any]:
    """The same config as transformers 5 writes it: rope settings in ``rope_parameters``."""
    out = copy.deepcopy(hf)
    theta, scaling = out.pop("rope_theta", 10000.0), out.pop("rope_scaling", None) or {"rope_type": "default"}
    params = {**scaling, "rope_theta": theta}
    if out["model_type"] == "gemma3_text":
        local = out.pop("rope_local_base_freq")
        params = {"full_attention": params, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    out["rope_parameters"] = params
    return out


# ------------------------------------------------------------------- float64 reference forward


def _rms(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * (1.0 + w) if gemma else normed * w


def _inv_freq(d: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    freqs = 1.0 / theta ** (np.arange(0, d, 2) / d)
    if not scaling:
        return freqs
    if scaling["rope_type"] == "linear":
        return freqs / scaling["factor"]
    # Llama 3.1's published rule, one frequency at a time.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def _rope(x: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half rotary embedding for positions 0..T-1; x is [T, heads, D]."""
    t, _, d = x.shape
    freqs = np.arange(t)[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_logits(flat: dict[str, np.ndarray], hf: dict[str, Any], ids: list[int]) -> np.ndarray:
    """The causal LM a transformers-4-format config.json describes, from its HF-named tensors."""
    w = {k: v.astype(np.float64) for k, v in flat.items()}
    gemma = hf["model_type"].startswith("gemma")
    heads, kv_heads, hidden = hf["num_attention_heads"], hf["num_key_value_heads"], hf["hidden_size"]
    d = hf.get("head_dim") or hidden // heads
    eps = hf["rms_norm_eps"]
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    if gemma:
        x = x * np.sqrt(hidden)  # Gemma normalises embeddings by sqrt(d_model)
    idx = np.arange(t)
    causal = idx[None, :] <= idx[:, None]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if gemma:
            types = hf.get("layer_types") or ["sliding_attention" if (j + 1) % 2 else "full_attention" for j in range(i + 1)]
            local = types[i] == "sliding_attention"
        else:
            local = False

        def proj(name: str, h: np.ndarray, p: str = p) -> np.ndarray:
            out = h @ w[p + name + ".weight"].T
            return out + w[p + name + ".bias"] if p + name + ".bias" in w else out

        h = _rms(x, w[p + "input_layernorm.weight"], eps, gemma)
        q = proj("self_attn.q_proj", h).reshape(t, heads, d)
        k = proj("self_attn.k_proj", h).reshape(t, kv_heads, d)
        v = proj("self_attn.v_proj", h).reshape(t, kv_heads, d)
        if p + "self_attn.q_norm.weight" in w:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        if local and "rope_local_base_freq" in hf:
            inv = _inv_freq(d, hf["rope_local_base_freq"], None)
        else:
            inv = _inv_freq(d, hf.get("rope_theta", 10000.0), hf.get("rope_scaling"))
        q, k = _rope(q, inv), _rope(k, inv)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hf.get("query_pre_attn_scalar") or d)
        if hf.get("attn_logit_softcapping"):
            cap = hf["attn_logit_softcapping"]
            scores = cap * np.tanh(scores / cap)
        mask = causal & ((idx[:, None] - idx[None, :] < hf["sliding_window"]) if local else True)
        scores = np.where(mask[None], scores, -np.inf)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", attn, v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        act = _gelu_tanh if gemma else (lambda z: z / (1 + np.exp(-z)))
        if gemma:
            x = x + _rms(out, w[p + "post_attention_layernorm.weight"], eps, True)
            h = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps, True)
            mlp = (act(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            x = x + _rms(mlp, w[p + "post_feedforward_layernorm.weight"], eps, True)
        else:
            x = x + out
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps, False)
            x = x + (act(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], eps, gemma)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    logits = x @ head.T
    if hf.get("final_logit_softcapping"):
        cap = hf["final_logit_softcapping"]
        logits = cap * np.tanh(logits / cap)
    return logits


# --------------------------------------------------------------------------------- helpers


def _random_tensors(hf: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """HF-named random tensors for the config, norms and biases perturbed so their layout shows."""
    model = init_model(config_from_hf(hf), seed=seed)
    rng = np.random.default_rng(seed)
    flat = to_hf(model)
    for name, arr in flat.items():
        scale = 0.3 if name.endswith(("norm.weight", ".bias")) else 0.25
        flat[name] = (rng.normal(0.0 if hf["model_type"].startswith("gemma") else 1.0, scale, arr.shape)
                      if name.endswith("norm.weight") else rng.normal(0.0, scale, arr.shape)).astype(np.float32)
    return flat


def write_checkpoint(directory: Path, hf: dict[str, Any], flat: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(flat, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def forward(model: Transformer, ids: list[int], *, jit: bool) -> np.ndarray:
    t = len(ids)
    args = (jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), jnp.int32))
    if not jit:
        return np.asarray(model(*args))[0]
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))(state, *args))[0]


IDS = [5, 17, 2, 9, 30, 11, 1, 7, 7, 40, 3, 22]


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_logits_match_the_published_architecture(tmp_path: Path, family: str) -> None:
    """Loaded from a transformers 5 config.json; the reference reads the transformers 4 one."""
    hf = FAMILIES[family]
    flat = _random_tensors(hf, seed=len(family))
    model = load_checkpoint(write_checkpoint(tmp_path, transformers5(hf), flat))
    want = reference_logits(flat, hf, IDS)
    np.testing.assert_allclose(forward(model, IDS, jit=True), want, atol=2e-4, rtol=2e-4)
    if family in ("gemma2", "llama3.1"):  # eager too (slow: op by op), where the new code paths are
        np.testing.assert_allclose(forward(model, IDS, jit=False), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_config_formats_give_the_same_architecture(family: str) -> None:
    assert config_from_hf(transformers5(FAMILIES[family])) == config_from_hf(FAMILIES[family])


def test_rope_base_and_scaling_are_not_silently_dropped() -> None:
    """The figures the issue found: theta fell back to 10000 and llama3 scaling was ignored."""
    for family in ("qwen2.5", "llama3.1"):
        cfg = config_from_hf(transformers5(FAMILIES[family]))
        assert cfg.rope_theta == FAMILIES[family]["rope_theta"]
    scaled = config_from_hf(transformers5(FAMILIES["llama3.1"])).rope_scaling
    assert scaled is not None and (scaled.type, scaled.factor, scaled.original_max_position_embeddings) == ("llama3", 8.0, 64)
    gemma3 = config_from_hf(transformers5(FAMILIES["gemma3"]))
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.global_layer_every) == (1e6, 100.0, 3)
    assert [gemma3.is_local_layer(i) for i in range(3)] == [True, True, False]


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("llama3.1", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
        ("qwen2.5", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}}, "'dynamic'"),
        ("llama3.1", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "beta_fast": 32}}, "beta_fast not understood"),
        ("qwen3", {"moe_intermediate_size": 64}, "moe_intermediate_size not understood for model_type 'qwen3'"),
        ("llama3.1", {"mlp_bias": True}, "mlp_bias True is not supported"),
        ("qwen2.5", {"use_sliding_window": True}, "use_sliding_window"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ("gemma3", {"model_type": "gemma3"}, "multimodal Gemma 3"),
        ("gemma3", {"layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "every-nth-layer"),
        ("llama3.1", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "disagrees with rope_parameters"),
        ("llama3.1", {"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_clearly(family: str, change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**FAMILIES[family], **change})
