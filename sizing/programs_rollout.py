"""A rollout server's programs on its TPU slice: the sampler's prefill (``Transformer.extend`` of
the longest chunk, a conversation prefilled again after new weights) and one cached decode step
(``Transformer.decode``), both at ``rollout.maxBatch`` rows over the server's tensor-parallel mesh,
beside the conversation cache (``session rows x longest bucket`` slots per layer)."""

from __future__ import annotations

from typing import Any

from stoker.sizing.compiler import Slice, compile_program
from stoker.sizing.programs import Program, matmul_params, model_config, shard_bytes
from stoker.spec import RLJobSpec, TransformerConfig


def decode_flops(config: TransformerConfig, rows: int, context: int) -> float:
    """Useful flops of one decode step: 2 per matmul parameter per row, plus attention over
    ``context`` cached slots (scores and values: 4 x layers x query width x context)."""
    from stoker.model.model import head_dim

    attention = 4 * config.num_layers * config.num_heads * head_dim(config) * context
    return float(rows * (2 * matmul_params(config) + attention))


def rollout_programs(spec: RLJobSpec, slice_: Slice) -> list[Program]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from stoker.model.hf import dtype_from_name
    from stoker.model.model import KVCache, LayerCache, Transformer, head_dim
    from stoker.rollout.mesh import cache_sharding, param_shardings, rollout_mesh
    from stoker.rollout.sessions import session_length
    from stoker.rollout.settings import RolloutSettings

    config, note = model_config(spec)
    settings = RolloutSettings.from_spec(spec)
    dtype = dtype_from_name(settings.dtype)
    mesh = rollout_mesh(config, settings.tensor_parallel, slice_.devices)
    devices = list(mesh.devices.flat)

    def slice_of(index: int) -> int:
        return 0  # a rollout server is one slice

    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, abstract = nnx.split(model)
    where = param_shardings(abstract, config, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, where)
    slots = session_length(config, settings.buckets)
    rows = settings.max_batch
    kv = cache_sharding(config, mesh)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:  # Any: stands in for a jax.Array
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def cache(batch: int) -> KVCache:
        shape = (batch, slots, config.num_kv_heads, head_dim(config))
        layer = LayerCache(placed(shape, dtype, kv), placed(shape, dtype, kv))
        return KVCache(tuple(layer for _ in range(config.num_layers)), placed((batch, slots), jnp.int32, rep))

    def ints(*shape: int, dtype: Any = jnp.int32) -> Any:
        return placed(shape, dtype, rep)

    def prefill(state: Any, cache: KVCache, chunk: jax.Array, positions: jax.Array, valid: jax.Array,
                last: jax.Array) -> Any:
        return nnx.merge(graphdef, state).extend(chunk, positions, valid, cache, logits_at=last)

    def decode(state: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array) -> Any:
        return nnx.merge(graphdef, state).decode(tokens, positions, cache)

    params = shard_bytes(state)
    # The conversation cache: one row per session plus the scratch row (rollout/sampling.py).
    store = shard_bytes(cache(settings.session_rows + 1).layers)
    batch_cache = shard_bytes(cache(rows))
    notes = [f"tp {mesh.shape['tp']}, {settings.session_rows} session rows x {slots} slots, {settings.dtype}"]
    if note:
        notes.append(note)
    out = []
    for name, fn, args, tokens, flops in (
        ("prefill", prefill, (state, cache(rows), ints(rows, slots), ints(rows, slots), ints(rows, slots, dtype=jnp.bool_),
                              ints(rows)), rows * slots, decode_flops(config, rows * slots, slots // 2)),
        ("decode", decode, (state, cache(rows), ints(rows), ints(rows)), rows, decode_flops(config, rows, slots)),
    ):
        compiled = compile_program(jax.jit(fn, donate_argnums=(1,)), args, devices, slice_of)
        terms = {"parameters": params, "KV cache": store, "batch KV": batch_cache,
                 "temporaries": compiled.required_temp_bytes or compiled.temp_bytes}
        shape = f"{rows} x {slots} tokens" if name == "prefill" else f"{rows} rows, {slots} slots"
        out.append(Program("rollout", name, shape, terms, compiled, tokens=tokens, model_flops=flops, notes=list(notes)))
    return out
