"""``stoker import GGUF --to DIR``: a llama.cpp/Ollama GGUF file as a Hugging Face-format directory.

The ``gguf`` package reads the file and dequantizes every tensor with numpy; this module maps
llama.cpp's names and layouts back to Hugging Face's (``stoker.model.hf``'s), writes config.json
(``stoker.hfconfig.config_to_hf``) from the GGUF metadata, and builds tokenizer.json,
tokenizer_config.json (with the chat template the GGUF carries) and generation_config.json.

What llama.cpp's converter changes, undone here: Gemma's RMSNorm weights are stored as 1 + w;
Llama's q/k projection rows are permuted for its interleaved rotary layout. What GGUF leaves
implicit, filled in as llama.cpp's own loader assumes it: Gemma 3's local layers (every 6th
global, rotary base 10000), Gemma 2's (every 2nd global), and ``query_pre_attn_scalar``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from stoker.checkpoint_files import WEIGHTS_FILE
from stoker.hfconfig import CONFIG_FILE, CheckpointError, config_to_hf
from stoker.spec import RopeScaling, TransformerConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm"}
_PLAIN_LAYER_NAMES = {"ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class GGUFImportError(Exception):
    """The GGUF file cannot be imported (said in user terms)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="GGUF", help="a GGUF file (llama.cpp, Ollama)")
    parser.add_argument("--to", required=True, metavar="DIR", help="where to write the Hugging Face-format directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the written weights (dequantized tensors are float32)")


class _Metadata:
    def __init__(self, reader: Any):
        self.fields = reader.fields
        self.arch = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def model(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _f32(value: Any) -> float:
    """A GGUF float32 as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def _config(meta: _Metadata, names: set[str], vocab_size: int) -> TransformerConfig:
    arch = meta.arch
    layers, hidden, heads = int(meta.model("block_count")), int(meta.model("embedding_length")), int(meta.model("attention.head_count"))
    head_dim = meta.model("attention.key_length")
    scaling_type, factor = meta.model("rope.scaling.type"), meta.model("rope.scaling.factor")
    if "rope_freqs.weight" in names:
        raise GGUFImportError("the GGUF stores its rope scaling as rope_freqs.weight (Llama 3.1's); not converted")
    if scaling_type not in (None, "none", "linear"):
        raise GGUFImportError(f"rope scaling {scaling_type!r} is not converted; expected none or linear")
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(meta.model("attention.head_count_kv", heads)),
        head_dim=int(head_dim) if head_dim is not None and int(head_dim) != hidden // heads else None,
        intermediate_size=int(meta.model("feed_forward_length")),
        max_seq_len=int(meta.model("context_length", 2048)),
        rms_norm_eps=_f32(meta.model("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(meta.model("rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling(type="linear", factor=_f32(factor)) if scaling_type == "linear" and factor else None,
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
    )
    if arch in ("gemma2", "gemma3"):
        dim = int(head_dim) if head_dim is not None else hidden // heads
        big = layers == (46 if arch == "gemma2" else 62)  # the 27B models scale queries by hidden/heads
        fields |= dict(
            mlp_activation="gelu-tanh", norm_unit_offset=True, sandwich_norms=True, embedding_scale=True,
            query_pre_attn_scalar=hidden // heads if big else dim,
            sliding_window=int(meta.model("attention.sliding_window", 4096)),
            global_layer_every=2 if arch == "gemma2" else 6,
        )
        if arch == "gemma2":
            fields |= dict(attn_logit_softcap=_f32(meta.model("attn_logit_softcapping", 50.0)),
                           final_logit_softcap=_f32(meta.model("final_logit_softcapping", 30.0)))
        else:
            fields["rope_local_theta"] = 10000.0
    return TransformerConfig(**fields)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama q/k row permutation (rotary halves interleaved per head)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str, gemma: bool) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        _, layer, base, suffix = parts
        table = {**_LAYER_NAMES, **(_GEMMA_LAYER_NAMES if gemma else _PLAIN_LAYER_NAMES)}
        if base in table:
            return f"model.layers.{layer}.{table[base]}.{suffix}"
    raise GGUFImportError(f"tensor {name!r} has no Hugging Face name for this architecture")


def _tensors(
    reader: Any, config: TransformerConfig, arch: str, dtype: Any, progress: Callable[[str], None]
) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    gemma = arch.startswith("gemma")
    out: dict[str, np.ndarray] = {}
    total = len(reader.tensors)
    for done, tensor in enumerate(reader.tensors):
        if done and done % max(1, total // 10) == 0:
            progress(f"dequantized {done}/{total} tensors")
        if tensor.name == "rope_freqs.weight":
            continue
        name = _hf_name(tensor.name, gemma)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        value = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if gemma and name.endswith("norm.weight"):
            value = value - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) scale; Hugging Face keeps w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _unpermute(value, config.num_heads if "q_proj" in name else config.num_kv_heads)
        out[name] = value.astype(dtype)
    return out


# ------------------------------------------------------------------------------- tokenizer


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece BPE vocabulary: a piece is made from two pieces, earlier the
    higher its score (SentencePiece and llama.cpp merge the best-scored adjacent pair first)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# Pre-tokenizer splits by tokenizer.ggml.pre, the text patterns the vocabularies' merges were learned
# on (llama.cpp keys them the same way): Llama 3's (digits in runs of up to 3), Qwen2's (one digit).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_BPE_SPLITS: dict[str, str | None] = {  # None: GPT-2's own split (the byte-level pre-tokenizer's regex)
    "default": None, "gpt2": None, "llama3": _LLAMA3_PATTERN, "llama-bpe": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN, "deepseek-r1-qwen": _QWEN2_PATTERN,
}
_IGNORE_MERGES = {"llama3", "llama-bpe", "llama-v3"}  # a word already in Llama 3's vocabulary is one token


def _spm_model(meta: _Metadata, tokens: list[str], types: list[int]) -> Any:
    """A SentencePiece (``llama``) vocabulary as a byte-fallback BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        {t: i for i, t in enumerate(tokens)}, _spm_merges(tokens, scores, types),
        unk_token=tokens[unk_id] if unk_id is not None else None, byte_fallback=True, fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if prefix else decode)
    return tokenizer


def _bpe_model(meta: _Metadata, tokens: list[str]) -> Any:
    """A byte-level BPE (``gpt2``: Llama 3, Qwen2/3) vocabulary: its merges, and the split its
    ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in _BPE_SPLITS:
        raise GGUFImportError(
            f"tokenizer.ggml.pre {pre!r} is not converted (known: {', '.join(sorted(_BPE_SPLITS))}); the weights were "
            "written: set model.tokenizer to the model's tokenizer.json"
        )
    merges: list[tuple[str, str]] = []
    for merge in meta.get("tokenizer.ggml.merges", []):
        left, _, right = str(merge).partition(" ")
        merges.append((left, right))
    model = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in _IGNORE_MERGES)
    tokenizer = Tokenizer(model)
    pattern = _BPE_SPLITS[pre]
    if pattern is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _tokenizer(meta: _Metadata) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json, generation_config.json) from the GGUF's vocabulary."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2"):
        raise GGUFImportError(
            f"tokenizer.ggml.model {kind!r} is not converted (SentencePiece 'llama' and byte-level BPE 'gpt2' are); "
            "the weights were written: set model.tokenizer to the model's tokenizer.json"
        )
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]
    byte_level = kind == "gpt2"
    tokenizer = _bpe_model(meta, tokens) if byte_level else _spm_model(meta, tokens, types)
    tokenizer.add_tokens([
        AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
        for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED, _UNKNOWN)
    ])

    def token(key: str) -> str | None:
        found = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(found)] if found is not None and 0 <= int(found) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    # Without the flag, SentencePiece files get a BOS (llama.cpp's default) and byte-level ones none.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", not byte_level))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    single = " ".join([*([bos] if add_bos and bos else []), "$A", *([eos] if add_eos and eos else [])])
    specials = [(t, tokens.index(t)) for t in {bos, eos} if t and t in single.split()]
    template = processors.TemplateProcessing(single=single, special_tokens=specials)
    tokenizer.post_processor = (
        processors.Sequence([processors.ByteLevel(trim_offsets=False), template]) if byte_level else template
    )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": token("unknown"),
        "pad_token": token("padding"), "add_bos_token": add_bos, "add_eos_token": add_eos,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    stop = [int(meta.get(f"tokenizer.ggml.{k}_token_id")) for k in ("eos", "eot") if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
    generation = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": list(dict.fromkeys(stop))}
    return tokenizer, {k: v for k, v in config.items() if v is not None}, generation


# ---------------------------------------------------------------------------------- import


def import_gguf(path: str | Path, target: str | Path, *, dtype: str = "float32",
                progress: Callable[[str], None] = lambda _: None) -> tuple[Path, list[str]]:
    """Write the Hugging Face directory; returns it and any notes (a tokenizer left out)."""
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        raise GGUFImportError("reading GGUF needs the gguf package: pip install 'stoker[gguf]'") from None
    # Here, not at the top: stoker.model.hf brings JAX, which `stoker import --help` never needs.
    from stoker.model.hf import encode_safetensors

    path, target = Path(path), Path(target)
    if (target / CONFIG_FILE).exists():
        raise GGUFImportError(f"{target} already holds a {CONFIG_FILE}; import to a new directory")
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise GGUFImportError(f"{path}: not a readable GGUF file ({err})") from None
    meta = _Metadata(reader)
    if meta.arch not in SUPPORTED:
        raise GGUFImportError(f"{path}: architecture {meta.arch!r} is not supported; expected one of {', '.join(SUPPORTED)}")
    names = {t.name for t in reader.tensors}
    token_list = meta.get("tokenizer.ggml.tokens")
    vocab_size = len(token_list) if token_list is not None else int(meta.model("vocab_size"))
    config = _config(meta, names, vocab_size)
    progress(f"{meta.arch}: {config.num_layers} layers, hidden {config.hidden_size}, vocabulary {vocab_size}; dequantizing")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    tensors = _tensors(reader, config, meta.arch, np_dtype, progress)
    progress(f"writing {target / WEIGHTS_FILE}")
    target.mkdir(parents=True, exist_ok=True)
    (target / CONFIG_FILE).write_text(json.dumps(config_to_hf(config, dtype), indent=2) + "\n")
    (target / WEIGHTS_FILE).write_bytes(encode_safetensors(tensors, metadata={"format": "pt"}))
    notes: list[str] = []
    try:
        progress("building the tokenizer")
        tokenizer, tokenizer_config, generation = _tokenizer(meta)
    except GGUFImportError as err:
        notes.append(str(err))
    else:
        tokenizer.save(str(target / "tokenizer.json"))
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return target, notes


def main(args: argparse.Namespace) -> int:
    try:
        target, notes = import_gguf(args.gguf, args.to, dtype=args.dtype, progress=lambda m: print(m, file=sys.stderr))
    except (GGUFImportError, CheckpointError) as err:
        print(f"stoker import: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"stoker import: {note}", file=sys.stderr)
    print(f"wrote {target}")
    return 0
