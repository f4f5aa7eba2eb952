"""Hugging Face-format checkpoints and tokenizers, written to a temp dir and loaded back."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from stoker.model.hf import (
    CheckpointError,
    config_from_hf,
    load_checkpoint,
    read_config,
    save_checkpoint,
    to_hf,
)
from stoker import validate_cmd
from stoker.model.model import init_model
from stoker.model.tokenizer import (
    TokenizerError,
    load_tokenizer,
    save_tokenizer,
    token_id,
    train_word_tokenizer,
)
from stoker.manifest import load_text
from stoker.spec import TransformerConfig

LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 40,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def write_llama_checkpoint(directory: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random checkpoint laid out exactly as transformers' LlamaForCausalLM saves it."""
    c = LLAMA_CONFIG
    h, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    tensors = {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(c))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def test_loads_a_llama_checkpoint_with_hf_names(tmp_path: Path) -> None:
    tensors = write_llama_checkpoint(tmp_path, np.random.default_rng(0))
    model = load_checkpoint(tmp_path)
    assert model.config.hidden_size == 16 and model.config.num_kv_heads == 2
    assert not model.config.tie_embeddings
    # PyTorch keeps Linear weights [out, in]; NNX kernels are [in, out].
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].self_attn.k_proj.kernel[...]), tensors["model.layers.1.self_attn.k_proj.weight"].T
    )
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.embedding[...]), tensors["model.embed_tokens.weight"])
    exported = to_hf(model)
    assert exported.keys() == tensors.keys()
    for name, arr in tensors.items():
        np.testing.assert_array_equal(exported[name], arr, err_msg=name)


@pytest.mark.parametrize(
    "cfg",
    [
        TransformerConfig(),
        TransformerConfig(tie_embeddings=False, attention_bias=True),
        TransformerConfig(qk_norm=True, head_dim=8, num_kv_heads=1),
    ],
    ids=["llama-tied", "qwen2-like", "qwen3-like"],
)
def test_save_then_load_round_trips_exactly(tmp_path: Path, cfg: TransformerConfig) -> None:
    model = init_model(cfg, seed=5)
    save_checkpoint(model, tmp_path)
    assert read_config(tmp_path) == cfg
    loaded = load_checkpoint(tmp_path)
    before, after = to_hf(model), to_hf(loaded)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_bfloat16_checkpoint_round_trips(tmp_path: Path) -> None:
    model = init_model(TransformerConfig(), seed=1, dtype=jnp.bfloat16)
    save_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_checkpoint(tmp_path, dtype=jnp.bfloat16)
    a, b = to_hf(model), to_hf(loaded)
    assert a["model.norm.weight"].dtype == ml_dtypes.bfloat16
    assert all(np.array_equal(a[k].view(np.uint16), b[k].view(np.uint16)) for k in a)


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    tensors = write_llama_checkpoint(tmp_path / "src", np.random.default_rng(1))
    shard = tmp_path / "sharded"
    shard.mkdir()
    (shard / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(shard / file))
    weight_map = {n: file for file, part in halves.items() for n in part}
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    exported = to_hf(load_checkpoint(shard))
    assert all(np.array_equal(exported[n], tensors[n]) for n in tensors)


def test_mismatched_checkpoints_are_refused_clearly(tmp_path: Path) -> None:
    tensors = write_llama_checkpoint(tmp_path, np.random.default_rng(2))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        load_checkpoint(tmp_path)

    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((5, 16), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight: checkpoint shape"):
        load_checkpoint(tmp_path)

    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope_type 'longrope' is not supported"),
    ],
)
def test_unsupported_configs_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**LLAMA_CONFIG, **change})


def test_qwen2_config_implies_attention_bias() -> None:
    cfg = config_from_hf({**LLAMA_CONFIG, "model_type": "qwen2", "tie_word_embeddings": True})
    assert cfg.attention_bias and cfg.tie_embeddings and not cfg.qk_norm
    assert config_from_hf({**LLAMA_CONFIG, "model_type": "qwen3"}).qk_norm


# ------------------------------------------------------------------------------- tokenizers

FROZENLAKE_LIKE = [
    "<s> grid : S F F F / F H F H / F F F H / H F F G you are at row 0 col 0 </s>",
    "action : left right up down <eos>",
    "reward 1 goal reached . hole fell . invalid action .",
]


def test_trained_word_tokenizer_round_trips_through_a_file(tmp_path: Path) -> None:
    tok = train_word_tokenizer(FROZENLAKE_LIKE, ["<pad>", "<s>", "</s>", "<eos>"])
    assert tok.get_vocab_size() < 64
    assert [token_id(tok, t) for t in ("<pad>", "<s>", "</s>", "<eos>", "<unk>")] == [0, 1, 2, 3, 4]
    path = save_tokenizer(tok, tmp_path)
    assert path.name == "tokenizer.json"
    loaded = load_tokenizer(tmp_path)
    text = "action : up <eos>"
    ids = loaded.encode(text).ids
    assert ids == tok.encode(text).ids
    assert ids[-1] == token_id(loaded, "<eos>")
    assert loaded.decode(ids, skip_special_tokens=False) == text
    assert loaded.encode("teleport").ids == [token_id(loaded, "<unk>")]


def test_bpe_tokenizer_decodes_words_back() -> None:
    tok = train_word_tokenizer(FROZENLAKE_LIKE * 5, ["<pad>", "<eos>"], kind="bpe", vocab_size=80)
    assert tok.get_vocab_size() <= 80
    ids = tok.encode("you are at row 0 <eos>").ids
    assert tok.decode(ids) == "you are at row 0"
    assert tok.decode(tok.encode("rowdown").ids) == "rowdown"  # unseen word, spelled from merges


def test_tokenizer_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    tok = train_word_tokenizer(["a b"], ["<eos>"])
    with pytest.raises(TokenizerError, match="'<bos>'"):
        token_id(tok, "<bos>")


# ------------------------------------------------------------- config.json is the source of truth


def _manifest(checkpoint: Path | str, architecture: str = "") -> str:
    return (
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: tiny}\n"
        f"spec:\n  model:\n    checkpoint: {checkpoint}\n{architecture}"
    )


def test_a_manifest_takes_the_architecture_from_the_checkpoint(tmp_path: Path) -> None:
    write_llama_checkpoint(tmp_path / "ckpt", np.random.default_rng(3))
    resaved = {k: v for k, v in LLAMA_CONFIG.items() if k != "rope_theta"} | {
        "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    }
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(resaved))
    jobs, problems = load_text(_manifest(tmp_path / "ckpt"), "job.yaml")
    assert problems == []
    arch = jobs[0].spec.model.architecture
    assert arch == read_config(tmp_path / "ckpt") and arch.rope_theta == 500000.0 and arch.hidden_size == 16
    # Fields that agree may be repeated; one that disagrees names both values.
    agreeing = "    architecture: {hiddenSize: 16, ropeTheta: 500000}\n"
    assert load_text(_manifest(tmp_path / "ckpt", agreeing), "job.yaml")[1] == []
    disagreeing = "    architecture: {hiddenSize: 16, ropeTheta: 10000, tieEmbeddings: true}\n"
    _, problems = load_text(_manifest(tmp_path / "ckpt", disagreeing), "job.yaml")
    assert [str(p) for p in problems] == [
        "job.yaml: spec.model.architecture.ropeTheta: got 10000.0; the checkpoint's config.json says 500000.0",
        "job.yaml: spec.model.architecture.tieEmbeddings: got True; the checkpoint's config.json says False",
    ]


def test_validate_reads_a_local_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_llama_checkpoint(tmp_path / "ckpt", np.random.default_rng(4))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(LLAMA_CONFIG | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    manifest = tmp_path / "job.yaml"
    manifest.write_text(_manifest(tmp_path / "ckpt"))
    assert validate_cmd.main(argparse.Namespace(files=[str(manifest)])) == 2
    err = capsys.readouterr().err
    assert "spec.model.checkpoint: rope_scaling: rope_type 'yarn' is not supported" in err
    # The checkpoint's context bounds the packed rows too (128 here, the default buckets reach 512).
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    assert validate_cmd.main(argparse.Namespace(files=[str(manifest)])) == 2
    assert "expected <= model.architecture.maxSeqLen (128)" in capsys.readouterr().err
    # A URI (a bucket) is left to the pods; a local path that does not exist is an error for a job
    # that runs here (this one's learner is the CPU default), not taken for a cluster path.
    manifest.write_text(_manifest("gs://bucket/model"))
    assert validate_cmd.main(argparse.Namespace(files=[str(manifest)])) == 0
    manifest.write_text(_manifest(Path("/models/not-here")))
    assert validate_cmd.main(argparse.Namespace(files=[str(manifest)])) == 2
    assert "spec.model.checkpoint: '/models/not-here' does not exist" in capsys.readouterr().err
