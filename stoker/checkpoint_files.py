"""A checkpoint directory's safetensors files, read from their headers only (no JAX, no weights).

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype, shape and byte range; reading it costs a few KB whatever the model's size.
``stoker validate`` checks those names, shapes and dtypes against the tensors the config.json's
architecture needs (``expected_tensors``, the same names ``stoker.model.hf`` loads), so a missing,
extra, misshapen, quantized or truncated tensor is reported before a job starts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from stoker.checkpoint_error import CheckpointError
from stoker.hf_experts import expert_weight_name, router_weight_name, uses_mixtral_names
from stoker.spec import TransformerConfig

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Present in some older Llama exports; recomputed on the fly, so never required or refused.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# safetensors dtype names the loader casts from, and the config.json dtype name each one is.
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class CheckpointFileError(CheckpointError):
    """A weights file or index that cannot be read as safetensors."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    file: str


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors one safetensors file holds; refuses a header that overruns the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{path}: {size} bytes; not a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointFileError(f"{path}: header of {length} bytes in a {size}-byte file; not a safetensors file")
            header = json.loads(f.read(length))
    except OSError as err:
        raise CheckpointFileError(f"{path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointFileError(f"{path}: the safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: the safetensors header is not a JSON object")
    out: dict[str, TensorInfo] = {}
    end_of_data = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFileError(f"{path}: tensor {name!r} has a malformed header entry") from None
        end_of_data = max(end_of_data, int(end))
        out[name] = TensorInfo(dtype, shape, path.name)
    if 8 + length + end_of_data > size:
        raise CheckpointFileError(
            f"{path}: truncated: the header places data up to byte {8 + length + end_of_data}, the file has {size}"
        )
    return out


def weight_files(directory: Path) -> list[str]:
    """The weights files a checkpoint directory is read from, as the loader reads them."""
    index = directory / INDEX_FILE
    if index.exists():
        return sorted(set(_weight_map(index).values()))
    if (directory / WEIGHTS_FILE).exists():
        return [WEIGHTS_FILE]
    return sorted(p.name for p in directory.glob("*.safetensors"))


def _weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointFileError(f"{index}: not readable JSON ({err})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFileError(f"{index}: expected a weight_map of tensor name -> file name")
    return weight_map


def checkpoint_tensors(directory: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of a checkpoint directory (one file or an index with shards), from the headers;
    an index naming a tensor its shard lacks is an error."""
    directory = Path(directory)
    files = weight_files(directory)
    if not files:
        raise CheckpointFileError(f"no .safetensors weights in {directory}")
    out: dict[str, TensorInfo] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise CheckpointFileError(f"{directory / INDEX_FILE} names shard {name}, which is not in {directory}")
        out.update(read_header(path))
    index = directory / INDEX_FILE
    if index.exists():
        for tensor, file in sorted(_weight_map(index).items()):
            if tensor not in out or out[tensor].file != file:
                raise CheckpointFileError(f"{index}: {tensor} is mapped to {file}, which does not hold it")
    return out


def _expert_tensors(config: TransformerConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts, one tensor per expert (Qwen3-MoE's or Mixtral's names)."""
    mixtral, hidden, inter = uses_mixtral_names(config), config.hidden_size, config.expert_size
    out: dict[str, tuple[int, ...]] = {router_weight_name(layer, mixtral): (config.num_experts, hidden)}
    for e in range(config.num_experts):
        out |= {
            expert_weight_name(layer, e, "gate_proj", mixtral): (inter, hidden),
            expert_weight_name(layer, e, "up_proj", mixtral): (inter, hidden),
            expert_weight_name(layer, e, "down_proj", mixtral): (hidden, inter),
        }
    return out


def expected_tensors(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape for every parameter of the architecture (PyTorch's
    [out, in] layout), as ``stoker.model.hf.to_hf`` names them."""
    hidden, heads, kv = config.hidden_size, config.num_heads, config.num_kv_heads
    head_dim = config.head_dim if config.head_dim is not None else hidden // heads
    inter = config.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_embeddings:
        out["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if config.is_moe_layer(i):
            out |= _expert_tensors(config, i)
        else:
            out |= {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        if config.attention_bias:
            out |= {
                p + "self_attn.q_proj.bias": (heads * head_dim,),
                p + "self_attn.k_proj.bias": (kv * head_dim,),
                p + "self_attn.v_proj.bias": (kv * head_dim,),
            }
        if config.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
        if config.sandwich_norms:
            out |= {p + "pre_feedforward_layernorm.weight": (hidden,), p + "post_feedforward_layernorm.weight": (hidden,)}
    return out


def tensor_problems(tensors: dict[str, TensorInfo], config: TransformerConfig) -> list[str]:
    """What keeps these tensors from loading into ``config``'s model: missing, unexpected,
    misshapen, or not a float dtype (quantized or integer tensors cannot be loaded)."""
    expected = expected_tensors(config)
    missing = [n for n in expected if n not in tensors]
    unexpected = sorted(
        n for n in tensors
        if n not in expected and not n.endswith(IGNORED_SUFFIXES) and not (config.tie_embeddings and n == "lm_head.weight")
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} the config needs are missing: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor{'s' if len(unexpected) > 1 else ''} the config has no place for: {_few(unexpected)}")
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is not None and info.shape != shape:
            problems.append(f"{name} in {info.file}: shape {list(info.shape)}; the config needs {list(shape)}")
    odd = sorted((n, t) for n, t in tensors.items() if t.dtype not in FLOAT_DTYPES and n in expected)
    for name, info in odd[:5]:
        problems.append(f"{name} in {info.file}: dtype {info.dtype}; expected one of {', '.join(FLOAT_DTYPES)}")
    return problems


def stored_dtype(tensors: dict[str, TensorInfo]) -> str | None:
    """The config.json dtype name all the float tensors share (``bfloat16``...), None when mixed."""
    names = {FLOAT_DTYPES.get(t.dtype) for t in tensors.values()}
    return names.pop() if len(names) == 1 else None


def _few(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def weight_problems(spec_checkpoint: str | None, config: TransformerConfig) -> list[tuple[str, str]]:
    """``(field path under spec, message)`` for a local checkpoint directory whose weights do not
    fit ``config`` (its config.json's architecture); nothing for a path that is not a local
    directory (a bucket, a path only the cluster has)."""
    if not spec_checkpoint or not Path(spec_checkpoint).expanduser().is_dir():
        return []
    try:
        tensors = checkpoint_tensors(Path(spec_checkpoint).expanduser())
    except CheckpointFileError as err:
        return [("model.checkpoint", str(err))]
    return [("model.checkpoint", problem) for problem in tensor_problems(tensors, config)]
