"""Hugging Face-format checkpoints: ``config.json`` + ``*.safetensors`` <-> ``Transformer``.

The NNX modules carry Hugging Face's names, so the mapping is mechanical:

    NNX path                               HF name                                   layout
    embed_tokens/embedding                 model.embed_tokens.weight                 same
    layers/0/self_attn/q_proj/kernel       model.layers.0.self_attn.q_proj.weight    transposed
    layers/0/self_attn/q_proj/bias         model.layers.0.self_attn.q_proj.bias      same
    layers/0/input_layernorm/weight        model.layers.0.input_layernorm.weight     same
    norm/weight                            model.norm.weight                         same
    lm_head/kernel                         lm_head.weight                            transposed

(``nnx.Linear`` keeps kernels as [in, out]; PyTorch's ``nn.Linear`` keeps weights as [out, in].)

Supported families (``stoker.hfconfig`` reads config.json): ``llama`` (Llama 3.1+ rope scaling
too), ``mistral`` (without a sliding window), ``qwen2`` (q/k/v biases), ``qwen3`` (per-head q/k
norms), ``gemma2``, ``gemma3_text``, and the mixtures of experts ``qwen3_moe`` and ``mixtral``.
Anything else is refused with a clear message rather than loaded subtly wrong.

Experts are the exception: the model holds a layer's experts stacked ([E, hidden, width],
``stoker.model.moe``), checkpoints one tensor per expert (``mlp.experts.5.gate_proj.weight``;
Mixtral's ``block_sparse_moe.experts.5.w1.weight``). The weight channel sends a stack whole under
``hf_name``'s ``model.layers.0.mlp.experts.gate_proj``; ``to_hf`` splits it, ``load_hf`` takes either.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, TensorSpec, deserialize, serialize

from stoker.checkpoint_files import IGNORED_SUFFIXES, INDEX_FILE, WEIGHTS_FILE, weight_files
from stoker.hf_experts import uses_mixtral_names
from stoker.hfconfig import CONFIG_FILE, CheckpointError, config_from_hf, config_to_hf, read_config
from stoker.model.model import Transformer
from stoker.model.moe import checkpoint_name, is_expert_stack, split_experts, stack_experts

__all__ = [
    "CheckpointError", "config_from_hf", "config_to_hf", "read_config", "load_checkpoint", "save_checkpoint",
    "read_weights", "load_hf", "to_hf", "dtype_from_name", "encode_safetensors", "decode_safetensors",
    "WEIGHTS_FILE", "INDEX_FILE", "hf_name", "param_items",
]

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------------------------ safetensors


def encode_safetensors(flat: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise arrays (bfloat16 included, which ``safetensors.numpy`` lacks) to safetensors bytes."""
    contiguous = {name: np.ascontiguousarray(arr) for name, arr in flat.items()}
    specs = {
        name: TensorSpec(dtype=arr.dtype.name, shape=arr.shape, data_ptr=arr.ctypes.data, data_len=arr.nbytes)
        for name, arr in contiguous.items()
    }
    # `contiguous` stays referenced until serialize returns, keeping every data_ptr valid.
    return bytes(serialize(specs, metadata=metadata))


def decode_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Parse safetensors bytes into numpy arrays (bfloat16 as ``ml_dtypes.bfloat16``)."""
    try:
        entries = deserialize(data)
    except SafetensorError as err:
        raise CheckpointError(f"not a valid safetensors payload: {err}") from err
    out: dict[str, np.ndarray] = {}
    for name, entry in entries:
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
        out[name] = np.frombuffer(entry["data"], dtype=dtype).reshape(entry["shape"])
    return out


def read_safetensors(path: str | Path, *, mmap: bool = False) -> dict[str, np.ndarray]:
    """A file's tensors; ``mmap``: memory-mapped views, so only the slices used are ever read."""
    if not mmap:
        return decode_safetensors(Path(path).read_bytes())
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
        out: dict[str, np.ndarray] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise CheckpointError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
            start, end = entry["data_offsets"]
            out[name] = data[start:end].view(dtype).reshape(entry["shape"])
        return out
    except (struct.error, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: not a valid safetensors file: {err}") from err


# ------------------------------------------------------------------------------ name mapping


def hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """HF tensor name for an NNX parameter path, and whether the array is transposed between them."""
    *module, leaf = (str(p) for p in path)
    if is_expert_stack(tuple(module), leaf):
        return f"model.{'.'.join(module)}.{leaf}", False
    if leaf not in ("kernel", "embedding", "weight", "bias"):
        raise ValueError(f"no Hugging Face name for parameter {'/'.join(map(str, path))}")
    prefix = "" if module and module[0] == "lm_head" else "model."
    suffix = "bias" if leaf == "bias" else "weight"
    return f"{prefix}{'.'.join(module)}.{suffix}", leaf == "kernel"


def param_items(model: nnx.Module) -> list[tuple[tuple[Any, ...], nnx.Variable[Any]]]:
    """The model's parameters as (NNX path, variable) pairs, in the order every mapping uses
    (``hf_name(path)`` names each)."""
    return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def _mixtral(model: nnx.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and uses_mixtral_names(config)


def to_hf(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter as a host numpy array under its HF name, in the model's dtype (experts one
    tensor each, as checkpoints hold them)."""
    items = param_items(model)
    values = jax.device_get([var.get_value() for _, var in items])
    mixtral = _mixtral(model)
    out: dict[str, np.ndarray] = {}
    for (path, _), value in zip(items, values, strict=True):
        name, transpose = hf_name(path)
        arr = np.asarray(value)
        if is_expert_stack(tuple(str(p) for p in path[:-1]), str(path[-1])):
            out |= split_experts(name, arr, mixtral)
        else:
            out[checkpoint_name(name, mixtral)] = np.ascontiguousarray(arr.T) if transpose else arr
    return out


def _stoker_names(model: nnx.Module, flat: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """``flat`` under ``hf_name``'s names: a checkpoint's per-expert tensors stacked, Mixtral's
    ``block_sparse_moe`` renamed ``mlp``. Anything else (a dense model's tensors, stacks the weight
    channel sent whole) is passed through."""
    config = getattr(model, "config", None)
    if config is None or not config.num_experts:
        return flat
    mixtral = uses_mixtral_names(config)
    out = dict(flat)
    if mixtral:
        for name in [n for n in out if ".block_sparse_moe.gate." in n]:
            out[name.replace(".block_sparse_moe.", ".mlp.", 1)] = out.pop(name)
    for path, _ in param_items(model):
        stacked, _ = hf_name(path)
        if is_expert_stack(tuple(str(p) for p in path[:-1]), str(path[-1])) and stacked not in out:
            found = stack_experts(out, stacked, config.num_experts, mixtral)
            if found is not None:
                out[stacked] = found[0]
                for name in found[1]:
                    del out[name]
    return out


def load_hf(model: nnx.Module, flat: Mapping[str, np.ndarray]) -> None:
    """Overwrite the model's parameters in place from HF-named arrays (cast to the model's dtype).

    Every parameter must be present with the right shape; extra tensors are an error too, except
    a tied model's redundant ``lm_head.weight`` and stale rotary tables. Sharded weights
    (``stoker.weights.shards.ShardedWeights``) load by slice instead, each parameter in its sharding."""
    load_into = getattr(flat, "load_into", None)
    if callable(load_into):
        load_into(model)
        return
    flat = _stoker_names(model, flat)
    items = param_items(model)
    expected = {hf_name(path)[0] for path, _ in items}
    tied = getattr(model, "lm_head", "absent") is None
    unexpected = sorted(
        n
        for n in flat
        if n not in expected and not n.endswith(IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight")
    )
    missing = sorted(expected - set(flat))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for path, var in items:
        name, transpose = hf_name(path)
        arr = flat[name].T if transpose else flat[name]
        current = var.get_value()
        if tuple(arr.shape) != tuple(current.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(flat[name].shape)} does not fit the model")
        # Keep placement (and committed-ness: jit caches on it) as it was, so sharded models stay
        # sharded and reloading weights never triggers a recompile. A placed parameter is cast on
        # the host and each device receives only its own shard: the whole array never lands on
        # one chip, which a model split over several chips may not fit. On a multi-host mesh
        # every process holds the same ``flat`` and places its own devices' shards.
        if isinstance(current, jax.Array) and not current.committed:
            placement = None
        else:
            placement = getattr(current, "sharding", None)
        if isinstance(placement, jax.sharding.Sharding):
            # Each device's slice cut (and cast) on its own: a memory-mapped checkpoint is read
            # only where this process's devices need it, and no whole tensor is copied to cast.
            value: jax.Array = jax.make_array_from_callback(
                tuple(current.shape), placement, functools.partial(_cut, arr, current.dtype)
            )
        else:
            value = jnp.asarray(arr, dtype=current.dtype)
        var.set_value(value)


def _cut(arr: np.ndarray, dtype: Any, index: Any) -> np.ndarray:
    """One device's slice of ``arr``, cast: only that slice is read or copied."""
    return np.ascontiguousarray(arr[index]).astype(dtype, copy=False)


# ---------------------------------------------------------------------------- checkpoints


def read_weights(directory: str | Path, *, mmap: bool = False) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory: ``model.safetensors`` or a sharded index
    (``mmap``: memory-mapped, see ``read_safetensors``)."""
    directory = Path(directory)
    files = weight_files(directory)
    if not files:
        raise CheckpointError(f"no .safetensors weights in {directory}")
    flat: dict[str, np.ndarray] = {}
    for name in files:
        flat.update(read_safetensors(directory / name, mmap=mmap))
    return flat


def load_checkpoint(
    directory: str | Path, *, dtype: jnp.dtype = jnp.float32,
    placement: Callable[[tuple[int, ...]], jax.sharding.Sharding] | None = None,
) -> Transformer:
    """A ``Transformer`` built from a Hugging Face-format directory (no random init is run).

    ``placement(shape)``: each parameter's sharding. The files are then memory-mapped and every
    device receives only its own slice straight from them: no device (and, over several hosts,
    no process) ever holds a whole tensor it does not own."""
    config = read_config(directory)
    flat = read_weights(directory, mmap=placement is not None)
    # eval_shape leaves abstract placeholders (no init compute); load_hf replaces every one of them.
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
    if placement is not None:
        nnx.update(model, jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement(tuple(a.shape))), nnx.state(model)
        ))
    load_hf(model, flat)
    return model


def save_checkpoint(model: Transformer, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` so ``load_checkpoint`` (or ``transformers``)
    reads the same weights back; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype_name = {jnp.dtype(v): k for k, v in _DTYPE_NAMES.items()}.get(jnp.dtype(model.dtype), "float32")
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config, dtype_name), indent=2) + "\n")
    (directory / WEIGHTS_FILE).write_bytes(encode_safetensors(to_hf(model), metadata={"format": "pt"}))
    return directory


def dtype_from_name(name: str) -> jnp.dtype:
    """``ModelSpec.dtype`` string -> jnp dtype."""
    try:
        return jnp.dtype(_DTYPE_NAMES[name])
    except KeyError as err:
        raise CheckpointError(f"dtype {name!r} is not supported; expected one of {sorted(_DTYPE_NAMES)}") from err
