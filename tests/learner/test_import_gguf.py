"""``stoker import GGUF``: a GGUF file written here the way llama.cpp's converter writes one (its
names, Gemma's 1 + w norms, Llama's permuted q/k rows, quantized matrices, a SentencePiece
vocabulary) becomes a Hugging Face directory Stoker and transformers read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType, GGUFWriter

from stoker.checkpoint_files import expected_tensors
from stoker.cli import main as stoker_main
from stoker.hfconfig import read_config
from stoker.model.hf import load_checkpoint, read_weights
from stoker.model.tokenizer import read_tokenizer_files
from stoker.spec import TransformerConfig

GEMMA3 = TransformerConfig(
    vocab_size=300, hidden_size=32, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=64,
    max_seq_len=128, rope_theta=1e6, rope_local_theta=1e4, tie_embeddings=True, qk_norm=True,
    mlp_activation="gelu-tanh", norm_unit_offset=True, sandwich_norms=True, embedding_scale=True,
    query_pre_attn_scalar=32, sliding_window=16, global_layer_every=6,
)
LLAMA = TransformerConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                          intermediate_size=64, max_seq_len=128, tie_embeddings=False)
_TO_GGUF = {  # Hugging Face -> llama.cpp names, as its converter writes them
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_feedforward_layernorm": "post_ffw_norm", "pre_feedforward_layernorm": "ffn_norm",
}
CHAT = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "wo", "wor", "worl", "world", "▁world", "▁w"]


def _gguf_name(name: str, gemma: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, *module, suffix = name.split(".")
    base = ".".join(module)
    table = dict(_TO_GGUF, post_attention_layernorm="post_attention_norm" if gemma else "ffn_norm")
    return f"blk.{layer}.{table[base]}.{suffix}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rotary halves interleaved row-wise."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    tokens = [*SPECIALS, "\n", *[f"<0x{b:02X}>" for b in range(256)], *PIECES]
    types = [3] * len(SPECIALS) + [4] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * (len(SPECIALS) + 1 + 256) + [-float(i) for i in range(len(PIECES))]
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>"), types.append(5), scores.append(0.0)
    return tokens, scores, types


def spm_vocabulary(writer: GGUFWriter, size: int) -> None:
    tokens, scores, types = _vocabulary(size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens), writer.add_token_scores(scores), writer.add_token_types(types)
    writer.add_bos_token_id(2), writer.add_eos_token_id(1), writer.add_unk_token_id(3), writer.add_pad_token_id(0)
    writer.add_add_bos_token(True), writer.add_add_space_prefix(False), writer.add_chat_template(CHAT)


def write_gguf(path: Path, arch: str, config: TransformerConfig, seed: int = 0,
               vocabulary: Callable[[GGUFWriter, int], None] = spm_vocabulary) -> dict[str, np.ndarray]:
    """Random Hugging Face weights, written as llama.cpp's converter would; returns the HF weights."""
    rng = np.random.default_rng(seed)
    hf = {n: rng.normal(scale=0.5, size=s).astype(np.float32) for n, s in expected_tensors(config).items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if config.head_dim:
        writer.add_key_length(config.head_dim), writer.add_value_length(config.head_dim)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    vocabulary(writer, config.vocab_size)
    gemma = arch.startswith("gemma")
    for name, value in hf.items():
        stored = value + 1.0 if gemma and name.endswith("norm.weight") else value
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = _permute(stored, config.num_heads if "q_proj" in name else config.num_kv_heads)
        if stored.ndim == 2 and "embed" not in name:  # matrices quantized, as a Q8_0 file has them
            quantized = gguf.quants.quantize(stored, GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name, gemma), quantized, raw_shape=quantized.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name, gemma), stored)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize(("arch", "config"), [("gemma3", GEMMA3), ("llama", LLAMA)])
def test_a_gguf_imports_to_the_weights_and_architecture_it_was_converted_from(
    tmp_path: Path, arch: str, config: TransformerConfig
) -> None:
    hf = write_gguf(tmp_path / "m.gguf", arch, config)
    assert stoker_main(["import", str(tmp_path / "m.gguf"), "--to", str(tmp_path / "hf")]) == 0
    assert read_config(tmp_path / "hf") == config
    back = read_weights(tmp_path / "hf")
    assert set(back) == set(hf)
    for name, value in hf.items():
        if value.ndim == 1 or "embed" in name:  # float32 in the file: exact (Gemma's 1 + w undone)
            np.testing.assert_allclose(back[name], value, atol=2e-7, err_msg=name)
        else:  # Q8_0: one scale per 32 values, 8-bit steps (and Llama's q/k rows back in order)
            step = np.abs(value).max() / 127
            np.testing.assert_allclose(back[name], value, atol=step, err_msg=name)
    load_checkpoint(tmp_path / "hf")  # loads as the model it names


def test_the_gguf_vocabulary_becomes_a_tokenizer_transformers_and_stoker_read_alike(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", "gemma3", GEMMA3)
    assert stoker_main(["import", str(tmp_path / "m.gguf"), "--to", str(tmp_path / "hf")]) == 0
    files = read_tokenizer_files(tmp_path / "hf")
    tok = files.tokenizer
    vocab = tok.get_vocab(with_added_tokens=True)
    # SentencePiece BPE: the best-scored merges win ("hello" before "hell"+"o"); BOS first.
    assert tok.encode("hello world").tokens == ["<bos>", "hello", "▁world"]
    # Bytes outside the vocabulary fall back to <0x..> tokens and decode back to the text.
    assert tok.encode("hé", add_special_tokens=False).tokens == ["h", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hello world\nhé").ids, skip_special_tokens=True) == "hello world\nhé"
    assert tok.encode("<start_of_turn>\n", add_special_tokens=False).ids == [vocab["<start_of_turn>"], vocab["\n"]]
    assert (files.bos_token, files.eos_token, files.chat_template) == ("<bos>", "<eos>", CHAT)
    assert files.eos_token_ids == (1,)
    referee = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ("hello world", "hello  hé\nworld", "<start_of_turn>hello<end_of_turn>"):
        assert referee(text)["input_ids"] == tok.encode(text).ids, text
    assert referee.apply_chat_template([{"role": "user", "content": " hello "}], tokenize=False) == (
        "<bos><start_of_turn>user\nhello<end_of_turn>\n"
    )


def test_import_refuses_what_it_cannot_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = GGUFWriter(str(tmp_path / "x.gguf"), "phi3")
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    assert stoker_main(["import", str(tmp_path / "x.gguf"), "--to", str(tmp_path / "out")]) == 2
    assert "architecture 'phi3' is not supported" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    assert stoker_main(["import", str(tmp_path / "bad.gguf"), "--to", str(tmp_path / "out")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert json.dumps({}) == "{}"


# ------------------------------------------------------------- byte-level BPE (gpt2) vocabularies


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 as itself, the rest from U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2", "12 3", "Ċ Ċ", "Ġ Ġ", "Ġ t"]
UNMERGED = "Ġthe"  # in the vocabulary, but no merge makes it (tiktoken-made vocabularies have such tokens)
BPE_SPECIALS = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_vocabulary(pre: str, add_bos: bool) -> Callable[[GGUFWriter, int], None]:
    def write(writer: GGUFWriter, size: int) -> None:
        tokens = [*_byte_alphabet(), *(m.replace(" ", "") for m in BPE_MERGES), UNMERGED, *BPE_SPECIALS, "<think>"]
        types = [1] * (len(tokens) - len(BPE_SPECIALS) - 1) + [3] * len(BPE_SPECIALS) + [4]
        while len(tokens) < size:  # padding entries, as Qwen's files carry
            tokens.append(f"[PAD{len(tokens)}]"), types.append(5)
        writer.add_tokenizer_model("gpt2"), writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens), writer.add_token_types(types), writer.add_token_merges(BPE_MERGES)
        writer.add_bos_token_id(tokens.index("<|begin_of_text|>")), writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(add_bos), writer.add_chat_template(QWEN_CHAT)
    return write


def _transformers_gguf_tokenizer(path: Path, arch: str) -> Any:
    """transformers' own GGUF tokenizer conversion (its builders, special tokens and split table),
    fed the file's tokenizer metadata read with the gguf package: transformers' GGUF reader imports
    torch, its tokenizer conversion does not."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    reader = gguf.GGUFReader(str(path))
    found = {key: field.contents() for key, field in reader.fields.items()}
    tokenizer_dict = {name: found[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{key}" in found}
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    return backend


BPE_TEXTS = [
    "hello world", "hello  world\n\n123 12345", "héllo wörld ☃ 日本", "<|im_start|>user\nhello<|im_end|>\n",
    "<think>hello</think> world", "it's 2024's  \t world\n", "  leading spaces",
]


@pytest.mark.parametrize(("arch", "pre", "add_bos"), [("qwen2", "qwen2", False), ("llama", "llama-bpe", True), ("qwen3", "default", False)])
def test_a_byte_level_bpe_vocabulary_tokenizes_as_transformers_reads_the_gguf(
    tmp_path: Path, arch: str, pre: str, add_bos: bool
) -> None:
    config = LLAMA.model_copy(update={"qk_norm": True, "head_dim": 8}) if arch == "qwen3" else LLAMA
    write_gguf(tmp_path / "m.gguf", arch, config, vocabulary=bpe_vocabulary(pre, add_bos))
    assert stoker_main(["import", str(tmp_path / "m.gguf"), "--to", str(tmp_path / "hf")]) == 0
    files = read_tokenizer_files(tmp_path / "hf")
    tok = files.tokenizer
    referee = _transformers_gguf_tokenizer(tmp_path / "m.gguf", arch)
    for text in BPE_TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == referee.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text, text
    vocab = tok.get_vocab(with_added_tokens=True)
    assert tok.encode("hello world", add_special_tokens=False).tokens == ["hello", "Ġworld"]
    assert (tok.encode("x").ids[0] == vocab["<|begin_of_text|>"]) is add_bos
    assert files.eos_token == "<|im_end|>" and files.chat_template == QWEN_CHAT
    conversation = [{"role": "user", "content": "hello world"}]
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    assert exported("hello world")["input_ids"] == tok.encode("hello world").ids
    # Llama 3 takes a word that is in its vocabulary whole (its tokenizer.json sets ignore_merges, as
    # llama.cpp does for llama-bpe); transformers' GGUF conversion does not, so this is not refereed.
    the = tok.encode(" the", add_special_tokens=False).tokens
    assert the == ([UNMERGED] if pre == "llama-bpe" else ["Ġt", "he"])
    if pre != "llama-bpe":
        assert referee.encode(" the", add_special_tokens=False).tokens == the
    digits = tok.encode("12345", add_special_tokens=False).tokens
    assert digits == (["123", "4", "5"] if pre == "llama-bpe" else ["1", "2", "3", "4", "5"] if pre == "qwen2" else ["123", "4", "5"])


def test_an_unknown_bpe_split_writes_the_weights_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(tmp_path / "m.gguf", "qwen2", LLAMA, vocabulary=bpe_vocabulary("made-up", False))
    assert stoker_main(["import", str(tmp_path / "m.gguf"), "--to", str(tmp_path / "hf")]) == 0
    assert "tokenizer.ggml.pre 'made-up' is not converted" in capsys.readouterr().err
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()
