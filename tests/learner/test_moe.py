"""Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) against an independent float64 forward
written from the published architectures (Mixtral, arXiv:2401.04088; the Qwen3 technical report
and its config.json fields), one token at a time and one expert at a time; their tensor names,
export round trip and the sampler's log-probs."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from stoker.checkpoint_files import expected_tensors
from stoker.learner.lora import LoraConfig, check_lora_targets
from stoker.model.hf import (
    CheckpointError, config_from_hf, config_to_hf, load_checkpoint, load_hf, read_weights, save_checkpoint, to_hf,
)
from stoker.model.logprobs import token_logprobs
from stoker.model.model import RematPolicy, Transformer, init_model, layer_period
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig

from .test_families import forward, write_checkpoint

BASE: dict[str, Any] = {
    "vocab_size": 48, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 40, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "rope_theta": 10000.0,
}
FAMILIES: dict[str, dict[str, Any]] = {
    # Layers 1 and 3 sparse (decoder_sparse_step 2), 0 and 2 dense; top-3 of 6, not renormalised.
    "qwen3_moe-step2": BASE | {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 4,
        "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 16, "norm_topk_prob": False,
        "decoder_sparse_step": 2, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
    },
    # Layer 0 dense (mlp_only_layers), 1 and 2 sparse; top-2 of 4, renormalised.
    "qwen3_moe-mlp_only": BASE | {
        "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 24, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    },
    # Every layer sparse, top-2 of 4 renormalised, experts intermediate_size wide.
    "mixtral": BASE | {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "output_router_logits": False,
        "sliding_window": None, "router_jitter_noise": 0.0, "attention_dropout": 0.0, "head_dim": None,
    },
}
IDS = [5, 17, 2, 9, 30, 11, 1, 7, 7, 40, 3, 22]


# ------------------------------------------------------------------- float64 reference forward


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half rotary embedding at positions 0..T-1 of x [T, heads, D]."""
    t, _, d = x.shape
    freqs = np.arange(t)[:, None] * (1.0 / theta ** (np.arange(0, d, 2) / d))[None]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return x * np.cos(emb) + np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1) * np.sin(emb)


def _silu(z: np.ndarray) -> np.ndarray:
    return z / (1 + np.exp(-z))


def _sparse_layers(hf: dict[str, Any]) -> list[bool]:
    """Mixtral: every layer; Qwen3-MoE: (i + 1) % decoder_sparse_step == 0 unless in mlp_only_layers."""
    n = hf["num_hidden_layers"]
    if hf["model_type"] == "mixtral":
        return [True] * n
    return [i not in hf["mlp_only_layers"] and (i + 1) % hf["decoder_sparse_step"] == 0 for i in range(n)]


def _moe_token(
    x: np.ndarray, w: dict[str, np.ndarray], p: str, hf: dict[str, Any], trace: list[tuple[np.ndarray, list[int]]]
) -> np.ndarray:
    """One token's sparse MLP: softmax router, top-k, (renormalised) weighted sum of SwiGLU experts.
    Appends the token's routing probabilities and chosen experts to ``trace``."""
    mixtral = hf["model_type"] == "mixtral"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    logits = w[block + "gate.weight"] @ x
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    top = sorted(range(len(probs)), key=lambda e: -probs[e])[: hf["num_experts_per_tok"]]
    weights = [probs[e] for e in top]
    trace.append((probs, top))
    if mixtral or hf["norm_topk_prob"]:
        weights = [g / sum(weights) for g in weights]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = np.zeros_like(x)
    for e, g in zip(top, weights, strict=True):
        gate, up, down = (w[f"{block}experts.{e}.{n}.weight"] for n in names)
        out += g * (down @ (_silu(gate @ x) * (up @ x)))
    return out


def reference_logits(
    flat: dict[str, np.ndarray], hf: dict[str, Any], ids: list[int], trace: list[tuple[np.ndarray, list[int]]] | None = None,
) -> np.ndarray:
    """The logits of ``ids``; ``trace`` collects every sparse layer's routing, token by token."""
    trace = [] if trace is None else trace
    w = {k: v.astype(np.float64) for k, v in flat.items()}
    heads, kv_heads, eps = hf["num_attention_heads"], hf["num_key_value_heads"], hf["rms_norm_eps"]
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((t, t), bool))
    for i, sparse in enumerate(_sparse_layers(hf)):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv_heads, d)
        if hf["model_type"] == "qwen3_moe":  # Qwen3's per-head q/k norms
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, hf["rope_theta"]), _rope(k, hf["rope_theta"])
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.where(causal[None], np.einsum("thd,shd->hts", q, k) / np.sqrt(d), -np.inf)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", attn, v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if sparse:
            x = x + np.stack([_moe_token(h[j], w, p, hf, trace) for j in range(t)])
        else:
            x = x + (_silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


# --------------------------------------------------------------------------------- helpers


def random_tensors(hf: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Random tensors under every name the checkpoint needs (``stoker validate``'s list), routers
    scaled up so each token's experts are far from ties."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in expected_tensors(config_from_hf(hf)).items():
        if name.endswith("norm.weight"):
            flat[name] = rng.normal(1.0, 0.3, shape).astype(np.float32)
        else:
            flat[name] = rng.normal(0.0, 1.0 if name.endswith("gate.weight") else 0.25, shape).astype(np.float32)
    return flat


# write_checkpoint and forward: the dense families' (tests/learner/test_families.py).


# ----------------------------------------------------------------------------------- tests


def test_config_json_fields_become_the_layer_layout() -> None:
    step2 = config_from_hf(FAMILIES["qwen3_moe-step2"])
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (step2.num_experts, step2.num_experts_per_tok, step2.expert_size, step2.norm_topk_prob) == (6, 3, 16, False)
    assert layer_period(step2) == 2 and step2.qk_norm
    only = config_from_hf(FAMILIES["qwen3_moe-mlp_only"])
    assert [only.is_moe_layer(i) for i in range(3)] == [False, True, True] and layer_period(only) == 3
    mixtral = config_from_hf(FAMILIES["mixtral"])
    assert [mixtral.is_moe_layer(i) for i in range(2)] == [True, True]
    assert (mixtral.num_experts, mixtral.expert_size, mixtral.norm_topk_prob, mixtral.qk_norm) == (4, 40, True, False)
    assert (mixtral.router_aux_loss_coef, mixtral.output_router_logits) == (0.02, False)
    # transformers 5 may write Qwen3-MoE's expert count as num_local_experts.
    renamed = {k: v for k, v in FAMILIES["qwen3_moe-step2"].items() if k != "num_experts"} | {"num_local_experts": 6}
    assert config_from_hf(renamed) == step2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_checkpoint_logits_match_the_published_architecture(tmp_path: Path, family: str) -> None:
    hf = FAMILIES[family]
    flat = random_tensors(hf, seed=len(family))
    model = load_checkpoint(write_checkpoint(tmp_path, hf, flat))
    want = reference_logits(flat, hf, IDS)
    np.testing.assert_allclose(forward(model, IDS, jit=True), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(forward(model, IDS, jit=False), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe-step2", "mixtral"])
def test_export_writes_the_checkpoint_back_as_transformers_names_it(tmp_path: Path, family: str) -> None:
    hf = FAMILIES[family]
    flat = random_tensors(hf, seed=3)
    model = load_checkpoint(write_checkpoint(tmp_path / "in", hf, flat))
    out = save_checkpoint(model, tmp_path / "out")
    written = read_weights(out)
    assert sorted(written) == sorted(flat)
    for name, array in flat.items():
        assert written[name].shape == array.shape and np.array_equal(written[name], array), name
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == hf["model_type"] and config_from_hf(exported) == config_from_hf(hf)
    again = to_hf(load_checkpoint(out))
    assert all(np.array_equal(again[n], a) for n, a in flat.items()) and sorted(again) == sorted(flat)
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_experts_per_tok) == (hf["model_type"], hf["num_experts_per_tok"])
    if family == "mixtral":
        assert config.num_local_experts == 4 and config.sliding_window is None
    else:
        assert (config.num_experts, config.moe_intermediate_size, config.decoder_sparse_step) == (6, 16, 2)


def test_sampler_logprobs_equal_the_training_forward(tmp_path: Path) -> None:
    """Prefill, decode and a session's cached extend route each token as the training forward does."""
    hf = FAMILIES["qwen3_moe-step2"]
    flat = random_tensors(hf, seed=1)
    model = load_checkpoint(write_checkpoint(tmp_path, hf, flat))
    sampler = Sampler(model.config, SamplingSpec(temperature=1.0, top_p=1.0), seed=0, buckets=(16,), min_batch=2, session_rows=2)
    sampler.load_weights(flat, version=1)
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(ids: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, state)(ids, jnp.arange(ids.shape[1])[None], jnp.ones(ids.shape, jnp.int32))
        return token_logprobs(logits[:, :-1], ids[:, 1:])

    prompt = [3, 1, 4, 1, 5]
    first = sampler.generate([prompt], max_new_tokens=4, sessions=["a"])[0]
    conversation = prompt + first.token_ids + [9, 2]
    second = sampler.generate([conversation], max_new_tokens=3, sessions=["a"])[0]
    full = np.asarray(score(jnp.asarray([conversation + second.token_ids], jnp.int32)))[0]
    np.testing.assert_allclose(first.logprobs, full[len(prompt) - 1 : len(prompt) + 3], atol=1e-4)
    np.testing.assert_allclose(second.logprobs, full[len(conversation) - 1 :], atol=1e-4)
    assert sampler.cache_stats.reused_tokens > 0


def test_a_random_moe_model_round_trips_through_the_checkpoint_format(tmp_path: Path) -> None:
    config = TransformerConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=24, num_experts=3,
        num_experts_per_tok=2,
    )
    model = init_model(config, seed=0)
    assert config_to_hf(config)["model_type"] == "mixtral"  # no q/k norms: Mixtral's names
    reloaded = load_checkpoint(save_checkpoint(model, tmp_path))
    assert reloaded.config == config
    before, after = to_hf(model), to_hf(reloaded)
    assert "model.layers.1.block_sparse_moe.experts.2.w2.weight" in after
    assert all(np.array_equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sliding_window": 4096}, "sliding-window attention is supported for Gemma only, not mixtral"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported"),
        ({"moe_intermediate_size": 16}, "moe_intermediate_size not understood for model_type 'mixtral'"),
        ({"num_experts_per_tok": 5}, "numExpertsPerTok must not exceed numExperts"),
    ],
)
def test_unsupported_moe_configs_are_refused_clearly(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**FAMILIES["mixtral"], **change})


def test_moe_without_a_family_is_refused_on_export() -> None:
    odd = TransformerConfig(num_experts=4, norm_topk_prob=False)
    with pytest.raises(CheckpointError, match="Mixtral, which has none of normTopkProb"):
        config_to_hf(odd)


def test_lora_on_the_experts_is_refused_clearly() -> None:
    config = config_from_hf(FAMILIES["qwen3_moe-step2"])
    check_lora_targets(config, LoraConfig(targets=("q_proj", "v_proj")))  # attention only: fine
    with pytest.raises(ValueError, match="LoRA on gate_proj, up_proj of a mixture-of-experts"):
        check_lora_targets(config, LoraConfig(targets=("q_proj", "gate_proj", "up_proj")))


def test_the_rematerialised_layer_scan_runs_dense_and_sparse_layers_alike(tmp_path: Path) -> None:
    """The learner's forward scans groups of layer_period layers (dense, sparse here): same values."""
    hf = FAMILIES["qwen3_moe-step2"]
    model = load_checkpoint(write_checkpoint(tmp_path, hf, random_tensors(hf, seed=2)))
    ids = jnp.asarray([IDS], jnp.int32)
    pos, seg = jnp.arange(len(IDS), dtype=jnp.int32)[None], jnp.ones((1, len(IDS)), jnp.int32)
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=1)
    def hidden(state: Any, remat: RematPolicy) -> jax.Array:
        return nnx.merge(graphdef, state).hidden_states(ids, pos, seg, remat=remat)

    np.testing.assert_allclose(hidden(state, "full"), hidden(state, "none"), atol=1e-5)


def test_the_weight_channel_carries_expert_stacks_whole(tmp_path: Path) -> None:
    """Sharded publishing and device-to-device copies send a layer's experts as one [E, hidden, width]
    stack; the sampler's model loads it (or the checkpoint's per-expert tensors) alike."""
    from stoker.distributed import Processes
    from stoker.weights.channel import WeightSubscriber
    from stoker.weights.publish import ShardedPublisher
    from stoker.weights.shards import DeviceWeights

    config = config_from_hf(FAMILIES["mixtral"])
    source = init_model(config, 3, jnp.bfloat16)
    want = to_hf(source)
    with ShardedPublisher(directory=str(tmp_path / "w"), address="127.0.0.1:0", auth_token="t", processes=Processes()) as pub:
        pub.publish(1, source)
        with WeightSubscriber(directory=tmp_path / "w") as subscriber:
            fetched = subscriber.fetch(1)
            assert fetched["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 40)
            for weights in (fetched, DeviceWeights(source), want):
                target = init_model(config, 4, jnp.bfloat16)
                load_hf(target, weights)
                got = to_hf(target)
                assert sorted(got) == sorted(want) and all(got[n].tobytes() == a.tobytes() for n, a in want.items())
