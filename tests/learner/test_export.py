"""``stoker export``: a run's policy or a checkpoint as a Hugging Face directory that reloads to the
same logits."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stoker.cli import main as stoker_main
from stoker.hfconfig import config_from_hf
from stoker.model.hf import load_checkpoint, save_checkpoint, to_hf
from stoker.model.model import Transformer, init_model
from stoker.weights.channel import WeightPublisher
from stoker.spec import RLJobSpec, RopeScaling, TransformerConfig

GEMMA3_LIKE = TransformerConfig(
    vocab_size=40, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=24,
    tie_embeddings=True, qk_norm=True, mlp_activation="gelu-tanh", norm_unit_offset=True, sandwich_norms=True,
    embedding_scale=True, query_pre_attn_scalar=8, sliding_window=3, global_layer_every=2, rope_theta=1e6,
    rope_local_theta=1e4, rope_scaling=RopeScaling(type="linear", factor=2.0),
)
LLAMA31_LIKE = TransformerConfig(rope_theta=5e5, tie_embeddings=False, rope_scaling=RopeScaling(
    type="llama3", factor=8.0, original_max_position_embeddings=64))
IDS = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], np.int32)


@partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef[Transformer], state: nnx.State) -> jax.Array:
    t = IDS.shape[1]
    return nnx.merge(graphdef, state)(jnp.asarray(IDS), jnp.arange(t)[None], jnp.ones((1, t), jnp.int32))


def _logits(model: Transformer) -> np.ndarray:
    """One compiled program per architecture (the source and the export share it)."""
    return np.asarray(_forward(*nnx.split(model)))


@pytest.mark.parametrize("config", [GEMMA3_LIKE, LLAMA31_LIKE], ids=["gemma3", "llama3.1"])
def test_a_checkpoint_exports_and_reloads_to_identical_logits(tmp_path: Path, config: TransformerConfig) -> None:
    source = save_checkpoint(init_model(config, seed=1), tmp_path / "src")
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert stoker_main(["export", str(source), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    assert (out / "tokenizer_config.json").read_text() == (source / "tokenizer_config.json").read_text()
    hf = json.loads((out / "config.json").read_text())
    # The keys transformers documents for the family (v4 and v5 rope formats both present).
    assert hf["model_type"] in ("gemma3_text", "llama") and "rope_parameters" in hf and "rope_theta" in hf
    assert config_from_hf(hf) == config
    np.testing.assert_array_equal(_logits(load_checkpoint(out)), _logits(load_checkpoint(source)))


def test_a_run_directory_exports_its_newest_published_policy(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate({"model": {"architecture": LLAMA31_LIKE.model_dump(by_alias=True)}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "runs.jsonl").write_text(json.dumps({"spec": spec.model_dump(by_alias=True, mode="json")}) + "\n")
    trained = init_model(LLAMA31_LIKE, seed=7)
    with WeightPublisher(directory=run / "weights") as publisher:
        publisher.publish(0, to_hf(init_model(LLAMA31_LIKE, seed=0)))
        publisher.publish(3, to_hf(trained))
    assert stoker_main(["export", str(run), "--to", str(tmp_path / "hf")]) == 0
    np.testing.assert_array_equal(_logits(load_checkpoint(tmp_path / "hf")), _logits(trained))


def test_export_refuses_what_it_cannot_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert stoker_main(["export", str(tmp_path), "--to", str(tmp_path / "x")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
    (tmp_path / "runs.jsonl").write_text(json.dumps({"spec": {}}) + "\n")
    assert stoker_main(["export", str(tmp_path), "--to", str(tmp_path / "x")]) == 2
    assert "no published weights yet" in capsys.readouterr().err
