"""Checkpoint files as transformers writes and reads them (its config and tokenizer classes, no
torch): what transformers saves loads in Stoker, and what Stoker exports loads in transformers."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from stoker.cli import main as stoker_main
from stoker.hfconfig import CheckpointError, config_from_hf, config_to_hf, read_config
from stoker.checkpoint_files import checkpoint_tensors, expected_tensors
from stoker.model.hf import WEIGHTS_FILE, encode_safetensors, read_weights
from stoker.spec import TransformerConfig

SMALL: dict[str, Any] = dict(
    vocab_size=48, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=24, max_position_embeddings=256,
)
# Every family Stoker loads, as transformers' own config classes build (and save) them.
FAMILIES: dict[str, tuple[type[Any], dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": False}),
    "llama3.1": (transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 8}),
    "gemma2": (transformers.Gemma2Config, {"head_dim": 8, "query_pre_attn_scalar": 24, "sliding_window": 5}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 8, "query_pre_attn_scalar": 24, "sliding_window": 5,
                                               "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 2
                                               + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]}),
}


def _saved_by_transformers(directory: Path, family: str) -> Any:
    cls, extra = FAMILIES[family]
    hf = cls(**{**SMALL, **extra})
    hf.save_pretrained(directory)
    return hf


def _rope_theta(hf: Any, layer_type: str = "full_attention") -> float:
    params = hf.rope_parameters
    params = params.get(layer_type, params)
    return float(params["rope_theta"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_configs_transformers_saves_load_as_what_transformers_reads(tmp_path: Path, family: str) -> None:
    hf = _saved_by_transformers(tmp_path, family)
    saved = json.loads((tmp_path / "config.json").read_text())
    if family in ("qwen2", "qwen3"):
        assert saved["layer_types"] == ["full_attention"] * SMALL["num_hidden_layers"]  # what used to be refused
    config = read_config(tmp_path)
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers)
    assert (config.num_heads, config.num_kv_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (config.head_dim or config.hidden_size // config.num_heads) == head_dim
    assert config.intermediate_size == hf.intermediate_size and config.rms_norm_eps == hf.rms_norm_eps
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.rope_theta == _rope_theta(hf)
    if family == "llama3.1":
        assert config.rope_scaling is not None and config.rope_scaling.type == "llama3"
        assert config.rope_scaling.original_max_position_embeddings == 64
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    assert [config.is_local_layer(i) for i in range(config.num_layers)] == [t == "sliding_attention" for t in types]
    if family.startswith("gemma"):
        assert config.sliding_window == hf.sliding_window and config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    if family == "gemma3":
        assert config.rope_local_theta == _rope_theta(hf, "sliding_attention")


def test_sliding_layer_types_outside_gemma_are_refused_by_name(tmp_path: Path) -> None:
    hf = transformers.Qwen2Config(**SMALL).to_diff_dict()
    hf["layer_types"] = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(CheckpointError, match=r"layer_types: layers \[1\] are sliding_attention.*Gemma only, not qwen2"):
        config_from_hf(hf)
    hf["layer_types"] = ["full_attention"]
    with pytest.raises(CheckpointError, match="layer_types: expected 3 of full_attention"):
        config_from_hf(hf)


def _declared_types(cls: type[Any]) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # evaluated annotations (get_type_hints needs torch's names)
        hints |= {k: v for k, v in vars(klass).get("__annotations__", {}).items() if not isinstance(v, str)}
    assert {"query_pre_attn_scalar", "vocab_size", "rms_norm_eps"} <= set(hints) or "gemma" not in cls.__name__.lower()
    return hints


def _matches(value: Any, declared: Any) -> bool:
    """Whether ``value`` is of the declared type (the strict reading transformers' configs apply)."""
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if declared is Any:
        return True
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_matches(value, a) for a in args)
    if declared is type(None):
        return value is None
    if origin in (list, tuple):
        return isinstance(value, (list, tuple))
    if origin is dict or declared is dict or typing.is_typeddict(declared):
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in args
    if declared is float:
        return isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool))
    if declared is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(declared, type):
        return isinstance(value, declared)
    raise AssertionError(f"no check for the declared type {declared!r}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exported_configs_load_in_transformers_with_every_field_in_its_declared_type(tmp_path: Path, family: str) -> None:
    _saved_by_transformers(tmp_path / "theirs", family)
    config = read_config(tmp_path / "theirs")
    exported = config_to_hf(config)
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(exported))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "ours")  # strict: raised on Gemma's 24.0
    assert type(loaded) is FAMILIES[family][0] or family == "mistral"
    declared = _declared_types(type(loaded))
    wrong = {k: v for k, v in exported.items() if k in declared and not _matches(v, declared[k])}
    assert wrong == {}, f"fields not in the type {type(loaded).__name__} declares: {wrong}"
    assert read_config(tmp_path / "ours") == config
    # transformers reads the architecture Stoker wrote: the same config Stoker reads from it.
    loaded.save_pretrained(tmp_path / "resaved")
    assert read_config(tmp_path / "resaved") == config


def test_query_pre_attn_scalar_is_an_integer_as_transformers_declares_it() -> None:
    gemma = dict(SMALL, model_type="gemma2", head_dim=8, query_pre_attn_scalar=24.0)
    config = config_from_hf(gemma)  # an older Stoker export's float still reads
    assert config_to_hf(config)["query_pre_attn_scalar"] == 24 and isinstance(config_to_hf(config)["query_pre_attn_scalar"], int)
    with pytest.raises(CheckpointError, match="query_pre_attn_scalar"):
        config_from_hf(dict(gemma, query_pre_attn_scalar=24.5))


def _random_weights(config: TransformerConfig, dtype: Any, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(dtype) for name, shape in expected_tensors(config).items()}


def test_a_bf16_checkpoint_exports_as_bf16_bit_for_bit(tmp_path: Path) -> None:
    source = tmp_path / "src"
    hf = _saved_by_transformers(source, "qwen3")
    assert hf.dtype in (None, "float32")  # what the config says is not what decides: the weights do
    config = read_config(source)
    weights = _random_weights(config, ml_dtypes.bfloat16)
    (source / WEIGHTS_FILE).write_bytes(encode_safetensors(weights, metadata={"format": "pt"}))
    assert stoker_main(["export", str(source), "--to", str(tmp_path / "out")]) == 0
    stored = checkpoint_tensors(tmp_path / "out")
    assert {t.dtype for t in stored.values()} == {"BF16"}
    assert (tmp_path / "out" / WEIGHTS_FILE).stat().st_size < 1.1 * (source / WEIGHTS_FILE).stat().st_size
    back = read_weights(tmp_path / "out")
    assert set(back) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(back[name].view(np.uint16), value.view(np.uint16), err_msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _word_tokenizer(directory: Path, specials: list[str]) -> Tokenizer:
    words = ["hello", "world", "the", "cat"]
    vocab = {t: i for i, t in enumerate([*specials, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def test_an_exported_gemma3_directory_loads_in_auto_config_and_auto_tokenizer(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _saved_by_transformers(source, "gemma3")
    config = read_config(source)
    (source / WEIGHTS_FILE).write_bytes(encode_safetensors(_random_weights(config, np.float32)))
    tokenizer = _word_tokenizer(source, ["<pad>", "<eos>", "<bos>", "<unk>"])
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }))
    assert stoker_main(["export", str(source), "--to", str(tmp_path / "out")]) == 0
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path / "out"), transformers.Gemma3TextConfig)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert theirs("hello the cat", add_special_tokens=False)["input_ids"] == tokenizer.encode("hello the cat").ids
    assert theirs.eos_token == "<eos>" and theirs.bos_token == "<bos>"
    assert theirs.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False) == "hello world"
