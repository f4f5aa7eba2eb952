"""A rollout server's programs on its TPU slice: the sampler's prefill (``Transformer.extend`` of
the longest chunk, a conversation prefilled again after new weights) and one cached decode step
(``Transformer.decode``, then the head and the draw as the sampler's loop runs them), both at ``rollout.maxBatch`` rows over the server's tensor-parallel mesh,
beside the conversation cache (``session rows x longest bucket`` slots per layer)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.model.decode_attention import runs_by_default, takes
from stoker.model.hf import dtype_from_name
from stoker.model.layers import LayerCache, head_dim
from stoker.model.model import KVCache, Transformer
from stoker.rollout.mesh import cache_sharding, param_shardings, rollout_mesh
from stoker.rollout.programs import call_limits, head_and_draw
from stoker.rollout.sessions import session_length
from stoker.rollout.settings import RolloutSettings
from stoker.sizing.compiler import Slice, compile_program
from stoker.model.flops import decode_flops
from stoker.sizing.programs import Program, model_config, on_devices, random_like, shard_bytes
from stoker.spec import RLJobSpec, TransformerConfig


def rollout_programs(spec: RLJobSpec, slice_: Slice, *, kinds: Collection[str] | None = None,
                     keep: bool = False) -> list[Program]:
    """A server's prefill and decode programs on ``slice_`` (``kinds``: only those); ``keep`` holds
    each compiled program, to run it on ``slice_``'s devices when they are real."""
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
    # The server's sampler on one TPU chip keeps its cache flat and decodes on the kernels
    # (rollout/sampling.py, ``decode_kernels``); over a mesh, the heads' layout and the select.
    flat = runs_by_default(devices[0].platform, mesh.size) and takes(slots)
    if flat:
        kv = rep  # one chip: nothing to split

    def placed(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:  # Any: stands in for a jax.Array
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def cache(batch: int) -> KVCache:
        shape: tuple[int, ...] = (batch, slots, config.num_kv_heads, head_dim(config))
        if flat:
            shape = (batch, slots, config.num_kv_heads * head_dim(config))
        layer = LayerCache(placed(shape, dtype, kv), placed(shape, dtype, kv))
        return KVCache(tuple(layer for _ in range(config.num_layers)), placed((batch, slots), jnp.int32, rep))

    def ints(*shape: int, dtype: Any = jnp.int32) -> Any:
        return placed(shape, dtype, rep)

    def prefill(state: Any, cache: KVCache, chunk: jax.Array, positions: jax.Array, valid: jax.Array,
                last: jax.Array) -> Any:
        return nnx.merge(graphdef, state).extend(chunk, positions, valid, cache, logits_at=last)

    sampling = settings.sampling

    def decode(state: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array, key_data: jax.Array) -> Any:
        # The sampler's step: the forward, then the head and the draw (what a decode step costs it).
        model = nnx.merge(graphdef, state)
        hidden, cache = model.decode(tokens, positions, cache, interpret=False if flat else None, head=False)
        limits = call_limits(1, (), np.ones(config.vocab_size, np.bool_), sampling.temperature, sampling)
        token, logprob = head_and_draw(model, hidden, jax.random.wrap_key_data(key_data), limits,
                                       use_top_p=sampling.top_p < 1.0, truncate=sampling.top_k > 0 or sampling.min_p > 0)
        return token, cache, logprob  # the cache second, where the bench carries it from run to run

    params = shard_bytes(state)
    # The conversation cache: one row per session plus the scratch row (rollout/sampling.py).
    store = shard_bytes(cache(settings.session_rows + 1).layers)
    batch_cache = shard_bytes(cache(rows))
    notes = [f"tp {mesh.shape['tp']}, {settings.session_rows} session rows x {slots} slots, {settings.dtype}"
             + (", decode kernels" if flat else "")]
    if note:
        notes.append(note)
    def prefill_inputs(shardings: Any, seed: int) -> tuple[Any, ...]:
        # The longest chunk into an empty cache: every row a whole conversation prefilled again.
        rng = np.random.default_rng(seed)
        host = (rng.integers(0, config.vocab_size, (rows, slots), dtype=np.int32),
                np.broadcast_to(np.arange(slots, dtype=np.int32), (rows, slots)), np.ones((rows, slots), np.bool_),
                np.full(rows, slots - 1, np.int32))
        return (random_like(state, shardings[0], seed), random_like(cache(rows), shardings[1], seed, 0.0),
                *on_devices(host, tuple(shardings[2:])))

    def decode_inputs(shardings: Any, seed: int) -> tuple[Any, ...]:
        # A step at the last slot of full rows: attention over the whole context, as decode_flops counts.
        rng = np.random.default_rng(seed)
        full = random_like(cache(rows), shardings[1], seed + 1)
        filled = np.ones((rows, slots), np.int32)
        filled[:, -1] = 0
        host = (rng.integers(0, config.vocab_size, rows, dtype=np.int32), np.full(rows, slots - 1, np.int32),
                np.asarray([seed, 1], np.uint32))
        return (random_like(state, shardings[0], seed),
                full._replace(segment_ids=jax.device_put(filled, shardings[1].segment_ids)),
                *on_devices(host, tuple(shardings[2:])))

    out = []
    programs: tuple[tuple[str, Callable[..., Any], tuple[Any, ...], int, float, Callable[[Any, int], tuple[Any, ...]]], ...] = (
        ("prefill", prefill, (state, cache(rows), ints(rows, slots), ints(rows, slots), ints(rows, slots, dtype=jnp.bool_),
                              ints(rows)), rows * slots, decode_flops(config, rows * slots, slots // 2), prefill_inputs),
        ("decode", decode, (state, cache(rows), ints(rows), ints(rows), ints(2, dtype=jnp.uint32)), rows,
         decode_flops(config, rows, slots),
         decode_inputs),
    )
    for name, fn, args, tokens, flops, inputs in programs:
        if kinds is not None and name not in kinds:
            continue
        compiled = compile_program(jax.jit(fn, donate_argnums=(1,)), args, devices, slice_of, keep=keep)
        terms = {"parameters": params, "KV cache": store, "batch KV": batch_cache,
                 "temporaries": compiled.required_temp_bytes or compiled.temp_bytes}
        shape = f"{rows} x {slots} tokens" if name == "prefill" else f"{rows} rows, {slots} slots"
        # The cache is donated: the next run writes into the one this run returned, as the sampler does.
        out.append(Program("rollout", name, shape, terms, compiled, tokens=tokens, model_flops=flops, notes=list(notes),
                           inputs=inputs, carry=((1, 1),)))
    return out
