"""``stoker validate`` reads a checkpoint's safetensors headers (one file or an index with shards)
and checks every tensor's name, shape and dtype against its config.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from stoker import validate_cmd
from stoker.checkpoint_files import checkpoint_tensors, expected_tensors, read_header
from stoker.hfconfig import config_from_hf
from stoker.model.hf import encode_safetensors, to_hf
from stoker.model.model import init_model
from stoker.spec import TransformerConfig

QWEN2: dict[str, object] = {
    "model_type": "qwen2", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 24, "max_position_embeddings": 1024, "tie_word_embeddings": False,
    "layer_types": ["full_attention", "full_attention"],
}


@pytest.mark.parametrize(
    "config",
    [
        TransformerConfig(tie_embeddings=False, attention_bias=True),
        TransformerConfig(qk_norm=True, head_dim=8, num_kv_heads=1),
        TransformerConfig(qk_norm=True, head_dim=8, sandwich_norms=True, norm_unit_offset=True, mlp_activation="gelu-tanh"),
    ],
    ids=["qwen2", "qwen3", "gemma3"],
)
def test_expected_tensors_are_the_models_own(config: TransformerConfig) -> None:
    flat = to_hf(init_model(config, seed=0))
    assert expected_tensors(config) == {name: arr.shape for name, arr in flat.items()}


def _write(directory: Path, tensors: dict[str, np.ndarray], hf: dict[str, object] = QWEN2) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    (directory / "model.safetensors").write_bytes(encode_safetensors(tensors, metadata={"format": "pt"}))


def _tensors(dtype: object = np.float32) -> dict[str, np.ndarray]:
    config = config_from_hf(QWEN2)
    return {n: np.zeros(shape, dtype) for n, shape in expected_tensors(config).items()}  # type: ignore[call-overload]


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: tiny}\n"
        f"spec:\n  model:\n    checkpoint: {tmp_path / 'ckpt'}\n  environment: {{name: swe}}\n"
    )
    code = validate_cmd.main(argparse.Namespace(files=[str(manifest)]))
    return code, capsys.readouterr().err


def test_validate_checks_names_shapes_and_dtypes_of_the_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    good = _tensors(ml_dtypes.bfloat16)
    _write(ckpt, good)
    assert _validate(tmp_path, capsys) == (0, "")

    missing = {k: v for k, v in good.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    _write(ckpt, missing | {"model.layers.0.self_attn.o_proj.bias": np.zeros(16, np.float32)})
    code, err = _validate(tmp_path, capsys)
    assert code == 2
    assert "spec.model.checkpoint: 1 tensor the config needs are missing: model.layers.1.self_attn.k_proj.bias" in err
    assert "1 tensor the config has no place for: model.layers.0.self_attn.o_proj.bias" in err

    _write(ckpt, good | {"model.layers.1.mlp.up_proj.weight": np.zeros((24, 8), np.float32)})
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and "model.layers.1.mlp.up_proj.weight in model.safetensors: shape [24, 8]; the config needs [24, 16]" in err

    _write(ckpt, good | {"model.norm.weight": np.zeros(16, np.int8)})
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and "model.norm.weight in model.safetensors: dtype I8; expected one of F32, BF16, F16, F64" in err

    # A tied model's redundant lm_head and stale rotary tables are what transformers' own files hold.
    tied = dict(QWEN2, tie_word_embeddings=True)
    _write(ckpt, good | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(2, np.float32)}, tied)
    assert _validate(tmp_path, capsys) == (0, "")


def test_validate_reads_a_truncated_file_and_a_sharded_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    good = _tensors()
    _write(ckpt, good)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])  # a download cut short
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and "model.safetensors: truncated" in err
    (ckpt / "model.safetensors").unlink()
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and "no .safetensors weights in" in err

    names = sorted(good)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: good[n] for n in part}, str(ckpt / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert _validate(tmp_path, capsys) == (0, "")
    assert set(checkpoint_tensors(ckpt)) == set(good)
    assert read_header(ckpt / "model-00002-of-00002.safetensors")[names[1]].shape == good[names[1]].shape

    wrong = dict(weight_map, **{names[0]: "model-00002-of-00002.safetensors"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wrong}))
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and f"{names[0]} is mapped to model-00002-of-00002.safetensors, which does not hold it" in err
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    code, err = _validate(tmp_path, capsys)
    assert code == 2 and "names shard model-00002-of-00002.safetensors, which is not in" in err
