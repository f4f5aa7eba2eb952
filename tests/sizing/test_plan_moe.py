"""`stoker plan` for a mixture of experts: useful flops from the active experts only (6 x the
matmul parameters a token goes through), and the expert axis compiled for a TPU slice."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from flax import nnx

from stoker.model.model import Transformer, count_params
from stoker.model.flops import decode_flops, matmul_params, train_flops
from stoker.spec import TransformerConfig
from tests.sizing.test_plan import plan

# Qwen3-30B-A3B's config.json (hub, 2025): 48 layers, every one sparse, 128 experts of width 768, top-8.
QWEN3_30B_A3B = TransformerConfig(
    vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
    intermediate_size=6144, max_seq_len=40960, rope_theta=1_000_000.0, tie_embeddings=False, qk_norm=True,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
)


def test_useful_flops_count_the_experts_a_token_is_routed_to_not_every_expert() -> None:
    total = count_params(nnx.eval_shape(lambda: Transformer(QWEN3_30B_A3B, rngs=nnx.Rngs(0))))
    active = matmul_params(QWEN3_30B_A3B) + QWEN3_30B_A3B.vocab_size * QWEN3_30B_A3B.hidden_size  # + the embedding
    # The model card's "30.5B total, 3.3B activated".
    assert total == pytest.approx(30.5e9, rel=0.01)
    assert active == pytest.approx(3.3e9, rel=0.02)
    c = QWEN3_30B_A3B
    attention = c.hidden_size * 128 * (2 * c.num_heads + 2 * c.num_kv_heads)
    per_layer = attention + 8 * 3 * c.hidden_size * 768 + c.hidden_size * 128  # 8 experts + the router
    assert matmul_params(c) == c.num_layers * per_layer + c.vocab_size * c.hidden_size
    assert train_flops(c, 2, 8192) == 2 * 8192 * (6 * matmul_params(c) + 6 * 48 * 32 * 128 * 8192)
    assert decode_flops(c, 4, 100) == 4 * (2 * matmul_params(c) + 4 * 48 * 32 * 128 * 100)
    # A dense layer counts its MLP whole; decoderSparseStep 2 makes every other layer dense.
    half = c.model_copy(update={"decoder_sparse_step": 2})
    assert matmul_params(half) == matmul_params(c) + 24 * (3 * c.hidden_size * 6144 - 8 * 3 * c.hidden_size * 768 - c.hidden_size * 128)


@pytest.mark.slow
def test_an_expert_parallel_learner_compiles_for_a_tpu_slice_with_its_experts_split(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    moe = ", numExperts: 8, numExpertsPerTok: 2, moeIntermediateSize: 64"
    results = {}
    for name, mesh in {"ep1": "{fsdp: 4}", "ep4": "{fsdp: 1, ep: 4, expertCapacityFactor: 1.25}"}.items():
        path = job(hidden=128, layers=2, mlp=256, learner=f", mesh: {mesh}")
        path.write_text(path.read_text().replace("maxSeqLen: 512}", f"maxSeqLen: 512{moe}}}"))
        code, out, _ = plan(capsys, str(path), "--topology", "v5e:2x2", "--json")
        assert code == 0
        results[name] = {p["program"]: p for p in json.loads(out)["programs"]}
    grad = results["ep4"]["grad 128"]
    assert "fsdp 1 x ep 4 x tp 1, experts routed by all-to-all (capacity factor 1.25)" in grad["notes"][0]
    assert grad["fits"] and grad["collective_bytes"]["ici"] > 0  # the all-to-alls and the gradients' reduction
    # The same useful flops whatever the layout: the active experts only.
    assert grad["model_flops"] == results["ep1"]["grad 128"]["model_flops"]
    # ...while the compiled work shrinks: each expert runs on its capacity, not on every token.
    assert grad["flops"] < results["ep1"]["grad 128"]["flops"]
    # The experts [8, 128, 64] x 3 x 2 layers, float32, split 4 ways over ep either way (fsdp or ep).
    assert grad["terms"]["parameters"] == results["ep1"]["grad 128"]["terms"]["parameters"]
