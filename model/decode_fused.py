"""The decode step's cache write done inside its attention kernel (issue 52): one Pallas call a
layer instead of two.

``write_rows`` reads each row's 16-slot tile around its new slot from HBM, sets the slot and
writes the tile back (a DMA into the cache must cover whole tiles), in a kernel of its own. The
attention kernel already holds the block of slots that contains the new slot in VMEM, so here the
new keys and values are set into that block before it is scored, and the tile around the slot is
written back to the cache (aliased in and out) from there: no read of the cache for the write,
and one launch a layer. The attention is ``decode_attention.ragged_decode_attention``'s, batched
over the rows of a block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stoker.model.decode_attention import (
    WRITE_ALIGN, accumulate_block, finish_softmax, own_heads, plan_grid, start_softmax,
)


def _kernel(
    lo_ref: Any, hi_ref: Any, at_ref: Any, q_ref: Any, qpos_ref: Any, kpos_ref: Any, k_ref: Any, v_ref: Any,
    new_k: Any, new_v: Any, o_ref: Any, k_out: Any, v_out: Any, m_ref: Any, l_ref: Any, acc_ref: Any,
    sem: Any, *, scale: float, softcap: float | None, window: int | None,
) -> None:
    group, block = pl.program_id(0), pl.program_id(1)
    rows, size, _ = k_ref.shape
    first = block * size
    pl.when(block == 0)(lambda: start_softmax(m_ref, l_ref, acc_ref))

    def new_slot(r: int) -> tuple[jax.Array, jax.Array, Any, list[Any]]:
        """Whether row r's new slot is in this block, the slot, its tile here, and the tile's DMAs."""
        b, slot = group * rows + r, at_ref[group * rows + r]
        tile = pl.ds(pl.multiple_of((slot & -WRITE_ALIGN) - first, WRITE_ALIGN), WRITE_ALIGN)
        to = pl.ds(pl.multiple_of(slot & -WRITE_ALIGN, WRITE_ALIGN), WRITE_ALIGN)
        here = (slot >= first) & (slot < first + size) & (slot < k_out.shape[1])
        dmas = [pltpu.make_async_copy(buf.at[r, tile], cache.at[b, to], sem) for buf, cache in ((k_ref, k_out), (v_ref, v_out))]
        return here, slot, tile, dmas

    @pl.when((block >= lo_ref[group]) & (block < hi_ref[group]))
    def _accumulate() -> None:
        for r in range(rows):  # the new slots set in the block, their tiles written back
            here, slot, tile, dmas = new_slot(r)

            @pl.when(here)
            def _write(r: int = r, slot: jax.Array = slot, tile: Any = tile, dmas: list[Any] = dmas) -> None:
                hit = jax.lax.broadcasted_iota(jnp.int32, (WRITE_ALIGN, 1), 0) == (slot & (WRITE_ALIGN - 1))
                k_ref[r, tile] = jnp.where(hit, new_k[r], k_ref[r, tile])
                v_ref[r, tile] = jnp.where(hit, new_v[r], v_ref[r, tile])
                for dma in dmas:
                    dma.start()

        accumulate_block(q_ref[...], k_ref[...], v_ref[...], qpos_ref[...], kpos_ref[...], m_ref, l_ref, acc_ref,
                         scale=scale, softcap=softcap, window=window)
        for r in range(rows):  # done before the pipeline reuses the block's buffers
            here, _, _, dmas = new_slot(r)
            pl.when(here)(functools.partial(_wait_all, dmas))

    pl.when(block == pl.num_programs(1) - 1)(lambda: finish_softmax(o_ref, l_ref, acc_ref))


def _wait_all(dmas: list[Any]) -> None:
    for dma in dmas:
        dma.wait()


def attend_and_write(
    q: jax.Array, keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array,
    q_positions: jax.Array, k_positions: jax.Array, *, scale: float, softcap: float | None = None,
    window: int | None = None, interpret: bool = False, block_slots: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``write_rows`` of the new keys and values into slot ``q_positions[b]`` of each row, then
    ``ragged_decode_attention`` over the written cache, in one kernel: (out [B, H, D], keys,
    values). ``k_positions`` already counts the new slots (as after the write). In place when the
    caches are donated; a slot outside the cache writes nothing."""
    rows, _, _ = q.shape
    _, slots, features = keys.shape
    grid = plan_grid(q, keys, q_positions, k_positions, window, block_slots)
    new = [x.astype(keys.dtype).reshape(rows, 1, features) for x in (new_keys, new_values)]
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    positions = q_positions.astype(jnp.int32)
    out, keys, values = pl.pallas_call(
        functools.partial(_kernel, scale=scale, softcap=softcap, window=window),
        out_shape=(jax.ShapeDtypeStruct(grid.q_flat.shape, jnp.float32),
                   jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # lo, hi, and each row's new slot
            grid=grid.shape,
            in_specs=[*grid.in_specs(features), grid.row_spec(1, features), grid.row_spec(1, features)],
            out_specs=(grid.row_spec(*grid.q_flat.shape[1:]), any_space, any_space),
            scratch_shapes=[*grid.scratch(), pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={6: 1, 7: 2},  # operands count the three prefetched arrays
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(grid.lo, grid.hi, positions, grid.q_flat, positions.reshape(rows, 1, 1),
      k_positions.astype(jnp.int32).reshape(rows, 1, slots), keys, values, *new)
    return own_heads(out, grid, q), keys, values
