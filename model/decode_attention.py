"""The sampler's decode step on a TPU as two Pallas kernels that touch only what a step needs.

``write_rows`` puts each row's new keys (or values) into its own slot of the cache in place: one
DMA of ``K * D`` elements a row into the donated buffer, where a select over the whole cache reads
and writes every slot (benchmarks/README.md, "Decode's cache write").

``ragged_decode_attention`` attends from one query a row over the slots that row may see,

    out_h = sum_s softmax_s(score_h(s)) v_s,   score_h(s) = c tanh(scale q_h.k_s / c)  (c: soft-cap)

over the visible slots s (``stoker.model.attention.visible``), reading the cache in blocks of
``block_slots`` and skipping the blocks past the last visible slot of each group of
``block_rows`` rows (and, for a sliding window, before the first): a row of 200 tokens in a
2,048-slot cache reads one block, not the whole buffer. Scores and the softmax are float32; the
softmax is accumulated online over the blocks (the result equals the dense one to rounding).

Both take the cache flat, [B, S, K * D]: the keys of a slot are one lane-dense vector, so a
64-wide head does not pad to the TPU's 128 lanes. Query head h reads kv head g(h) = h // (H / K);
the kernel multiplies a query zero outside its own head's lanes by the whole flat key, which is
the same dot product, and the caller keeps each head's own lanes of the output.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stoker.model.attention import MASKED

# A key position no query reaches: the flat position of an unfilled slot.
UNFILLED = 1 << 30
# Bytes of one cache block (keys or values) in on-chip memory; four are live (double-buffered).
BLOCK_BYTES = 1 << 20
ROWS_PER_BLOCK = 16
# Slots of one HBM tile (bfloat16 packs two a sublane): the write's DMAs start on one (a power of 2).
WRITE_ALIGN = 16


def _write_kernel(
    slot_ref: Any, slot_vec: Any, new_k: Any, new_v: Any, _k_in: Any, _v_in: Any, k_out: Any, v_out: Any,
    k_buf: Any, v_buf: Any, sem: Any,
) -> None:
    rows, align, _ = k_buf.shape
    slots = k_out.shape[1]

    def window(b: jax.Array) -> Any:  # a slot outside the cache rewrites the first window as it is
        at = slot_ref[b]
        return pl.ds(pl.multiple_of(jnp.where((at >= 0) & (at < slots), at & -align, 0), align), align)

    def dmas(b: jax.Array, to_cache: bool) -> list[Any]:
        pairs = ((k_buf.at[b], k_out.at[b, window(b)]), (v_buf.at[b], v_out.at[b, window(b)]))
        return [pltpu.make_async_copy(*((buf, hbm) if to_cache else (hbm, buf)), sem) for buf, hbm in pairs]

    def wait_all(to_cache: bool) -> None:
        # One wait for the bytes of every row's copies: a descriptor of their total size.
        for buf, hbm in ((k_buf, k_out), (v_buf, v_out)):
            whole = hbm.at[:, pl.ds(0, align)]
            pltpu.make_async_copy(*((buf, whole) if to_cache else (whole, buf)), sem).wait()

    def start_reads(b: jax.Array, carry: None) -> None:
        for copy in dmas(b, to_cache=False):
            copy.start()

    def start_writes(b: jax.Array, carry: None) -> None:  # (a loop body per direction: jax caches traces by function)
        for copy in dmas(b, to_cache=True):
            copy.start()

    # The tile-aligned window around each row's slot is read, changed in one slot, written back:
    # a DMA into HBM must start on a tile boundary of the slots.
    jax.lax.fori_loop(0, rows, start_reads, None)
    wait_all(to_cache=False)
    at = slot_vec[...]  # [B, 1, 1]
    hit = (jax.lax.broadcasted_iota(jnp.int32, k_buf.shape, 1) == (at & (align - 1))) & (at >= 0) & (at < slots)
    k_buf[...] = jnp.where(hit, new_k[...], k_buf[...])
    v_buf[...] = jnp.where(hit, new_v[...], v_buf[...])
    jax.lax.fori_loop(0, rows, start_writes, None)
    wait_all(to_cache=True)


def write_rows(
    keys: jax.Array, values: jax.Array, new_keys: jax.Array, new_values: jax.Array, slots: jax.Array,
    *, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Cache [B, S, F] x2, new [B, F] x2, slots [B] -> the caches with row b's slot ``slots[b]``
    set to its new keys/values; every other slot untouched. In place when the caches are donated
    (or carried by a loop); a slot outside [0, S) writes nothing. ``S`` must be a multiple of
    ``WRITE_ALIGN``."""
    rows, slots_total, features = keys.shape
    if slots_total % WRITE_ALIGN:
        raise ValueError(f"{slots_total} cache slots: write_rows needs a multiple of {WRITE_ALIGN}")
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    whole = pl.BlockSpec((rows, 1, features), lambda i, slots: (0, 0, 0))
    new = [x.astype(keys.dtype).reshape(rows, 1, features) for x in (new_keys, new_values)]
    slots = slots.astype(jnp.int32)
    call = pl.pallas_call(
        _write_kernel,
        out_shape=(jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((rows, 1, 1), lambda i, slots: (0, 0, 0)), whole, whole, any_space, any_space],
            out_specs=(any_space, any_space),
            scratch_shapes=[pltpu.VMEM((rows, WRITE_ALIGN, features), keys.dtype)] * 2 + [pltpu.SemaphoreType.DMA(())],
        ),
        input_output_aliases={4: 0, 5: 1},  # operands count the prefetched slots
        interpret=pltpu.InterpretParams() if interpret else False,
    )
    out: tuple[jax.Array, jax.Array] = call(slots, slots.reshape(rows, 1, 1), *new, keys, values)
    return out


def start_softmax(m_ref: Any, l_ref: Any, acc_ref: Any) -> None:
    """The online softmax's state before a group's first block."""
    m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def accumulate_block(
    q: jax.Array, keys: jax.Array, values: jax.Array, qpos: jax.Array, kpos: jax.Array, m_ref: Any, l_ref: Any,
    acc_ref: Any, *, scale: float, softcap: float | None, window: int | None,
) -> None:
    """One block of slots into the online softmax of a group's rows, all rows at once: batched
    matmuls [R, Hp, F] x [R, bs, F]^T, the state read and written once. On the v5e 1.3x (128 rows)
    to 1.8x (256) the speed of a loop over the rows (benchmarks/README.md, "The attention kernel's
    rows at once")."""
    scores = jnp.einsum("rhf,rsf->rhs", q, keys, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    seen = kpos <= qpos  # [R, 1, bs] from [R, 1, bs] and [R, 1, 1]
    if window is not None:
        seen &= qpos - kpos < window
    scores = jnp.where(seen, scores, MASKED)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    probs = jnp.where(seen, jnp.exp(scores - m_next), 0.0)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(probs, axis=-1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.einsum(
        "rhs,rsf->rhf", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    m_ref[...] = m_next


def finish_softmax(o_ref: Any, l_ref: Any, acc_ref: Any) -> None:
    """The group's output from the state after its last block (zeros for a row that saw nothing)."""
    total = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(total > 0, total, 1.0)).astype(o_ref.dtype)


def _attention_kernel(
    lo_ref: Any, hi_ref: Any, q_ref: Any, qpos_ref: Any, kpos_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any,
    m_ref: Any, l_ref: Any, acc_ref: Any, *, scale: float, softcap: float | None, window: int | None,
) -> None:
    group, block = pl.program_id(0), pl.program_id(1)
    pl.when(block == 0)(lambda: start_softmax(m_ref, l_ref, acc_ref))

    @pl.when((block >= lo_ref[group]) & (block < hi_ref[group]))
    def _accumulate() -> None:
        accumulate_block(q_ref[...], k_ref[...], v_ref[...], qpos_ref[...], kpos_ref[...], m_ref, l_ref, acc_ref,
                         scale=scale, softcap=softcap, window=window)

    pl.when(block == pl.num_programs(1) - 1)(lambda: finish_softmax(o_ref, l_ref, acc_ref))


def runs_by_default(platform: str, devices: int) -> bool:
    """Whether a sampler decodes on the kernels unless told: on one TPU chip (they do not split a
    cache over a mesh)."""
    return platform == "tpu" and devices == 1


def takes(slots: int) -> bool:
    """Whether the kernels take a cache of ``slots`` slots: a multiple of the write's tile, and of
    128 or at most 128 (a longer cache of another length would be one block too big for VMEM)."""
    return slots % WRITE_ALIGN == 0 and (slots % 128 == 0 or slots <= 128)


def block_sizes(rows: int, slots: int, features: int, itemsize: int) -> tuple[int, int]:
    """(rows, slots) of one kernel block: up to ``ROWS_PER_BLOCK`` rows, and the largest power of
    two >= 128 dividing ``slots`` whose block fits ``BLOCK_BYTES`` (all of them when 128 does
    not divide ``slots``: a short cache is one block)."""
    block_rows = next(r for r in range(min(ROWS_PER_BLOCK, rows), 0, -1) if rows % r == 0)
    block = 128
    if slots % block:
        return block_rows, slots
    while slots % (2 * block) == 0 and block_rows * 2 * block * features * itemsize <= BLOCK_BYTES:
        block *= 2
    return block_rows, block


def key_positions(segments: jax.Array, positions: jax.Array) -> jax.Array:
    """[B, S] segments and key positions -> each slot's position, ``UNFILLED`` where empty."""
    return jnp.where(segments != 0, positions, UNFILLED).astype(jnp.int32)


def query_lanes(q: jax.Array, features: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """q [B, H, D] -> (each query in its own kv head's lanes of the flat key, zero elsewhere, heads
    padded to a bfloat16 tile's 16 sublanes: [B, Hp, K * D]; each head's kv head [H])."""
    rows, heads, dim = q.shape
    kv_heads = features // dim
    own = jnp.arange(heads) // (heads // kv_heads)
    lanes = jax.nn.one_hot(own, kv_heads, dtype=q.dtype)[:, :, None]  # [H, K, 1]
    q_flat = (q[:, :, None, :] * lanes).reshape(rows, heads, features)
    padded_heads = -(-heads // 16) * 16
    return jnp.pad(q_flat, ((0, 0), (0, padded_heads - heads), (0, 0))).astype(dtype), own


def visited_blocks(
    q_positions: jax.Array, k_positions: jax.Array, window: int | None, block_rows: int, block: int
) -> tuple[jax.Array, jax.Array]:
    """The blocks of slots each group of rows visits, [lo, hi): from the first visible slot's block
    to the last's."""
    rows, slots = k_positions.shape
    groups, blocks = rows // block_rows, slots // block
    seen = k_positions <= q_positions[:, None]
    if window is not None:
        seen &= q_positions[:, None] - k_positions < window
    per_block = jnp.any(seen.reshape(groups, block_rows, blocks, block), axis=(1, 3))  # [groups, blocks]
    index = jnp.arange(blocks, dtype=jnp.int32)
    lo = jnp.min(jnp.where(per_block, index, blocks), axis=1).astype(jnp.int32)
    hi = (jnp.max(jnp.where(per_block, index, -1), axis=1) + 1).astype(jnp.int32)
    return lo, hi


class Grid(NamedTuple):
    """How a decode kernel walks a flat cache of ``slots`` slots: blocks of ``block_rows`` rows x
    ``block`` slots, each group of rows visiting blocks [lo, hi); the queries in their kv heads'
    lanes (``q_flat``) and each head's kv head (``own``). Its specs take the scalar-prefetched
    ``lo`` and ``hi`` first (a kernel may prefetch more after them)."""

    block_rows: int
    block: int
    slots: int
    q_flat: jax.Array
    own: jax.Array
    lo: jax.Array
    hi: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.q_flat.shape[0] // self.block_rows, self.slots // self.block

    def block_index(self, g: jax.Array, j: jax.Array, lo: Any, hi: Any) -> jax.Array:
        # Outside [lo, hi) the index repeats its neighbour's: the pipeline fetches nothing new.
        return jnp.maximum(jnp.minimum(j, hi[g] - 1), jnp.minimum(lo[g], self.shape[1] - 1))

    def row_spec(self, *tail: int) -> Any:
        """A group's rows of an array [B, *tail], whole."""
        return pl.BlockSpec((self.block_rows, *tail), lambda g, j, *_: (g, 0, 0))

    def in_specs(self, features: int) -> list[Any]:
        """Queries, their positions [B, 1, 1], key positions [B, 1, S], keys and values [B, S, F]."""
        kv = pl.BlockSpec((self.block_rows, self.block, features),
                          lambda g, j, lo, hi, *_: (g, self.block_index(g, j, lo, hi), 0))
        positions = pl.BlockSpec((self.block_rows, 1, self.block),
                                 lambda g, j, lo, hi, *_: (g, 0, self.block_index(g, j, lo, hi)))
        return [self.row_spec(*self.q_flat.shape[1:]), self.row_spec(1, 1), positions, kv, kv]

    def scratch(self) -> list[Any]:
        """The online softmax's running max and sum (a column a row) and its accumulator."""
        stats = (self.block_rows, self.q_flat.shape[1], 1)
        return [pltpu.VMEM(stats, jnp.float32), pltpu.VMEM(stats, jnp.float32),
                pltpu.VMEM((self.block_rows, *self.q_flat.shape[1:]), jnp.float32)]


def plan_grid(
    q: jax.Array, keys: jax.Array, q_positions: jax.Array, k_positions: jax.Array, window: int | None,
    block_slots: int | None,
) -> Grid:
    rows, _, _ = q.shape
    _, slots, features = keys.shape
    block_rows, block = block_sizes(rows, slots, features, keys.dtype.itemsize)
    block = block_slots or block
    q_flat, own = query_lanes(q, features, keys.dtype)
    lo, hi = visited_blocks(q_positions, k_positions, window, block_rows, block)
    return Grid(block_rows, block, slots, q_flat, own, lo, hi)


def own_heads(out: jax.Array, grid: Grid, q: jax.Array) -> jax.Array:
    """A kernel's [B, Hp, K * D] float32 output -> each head's own lanes, [B, H, D] in q's dtype."""
    rows, heads, dim = q.shape
    out = out[:, :heads].reshape(rows, heads, out.shape[-1] // dim, dim)
    return jnp.take_along_axis(out, grid.own[None, :, None, None], axis=2)[:, :, 0].astype(q.dtype)


def ragged_decode_attention(
    q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array, k_positions: jax.Array,
    *, scale: float, softcap: float | None = None, window: int | None = None, interpret: bool = False,
    block_slots: int | None = None,
) -> jax.Array:
    """q [B, H, D], flat cache [B, S, K * D] x2, q_positions [B], k_positions [B, S] (from
    ``key_positions``) -> [B, H, D] in q's dtype. Slot s is visible from row b's query iff
    ``k_positions[b, s] <= q_positions[b]`` (and within ``window``); a row that sees nothing
    gets zeros. ``block_slots``: the slots of one block (default: ``block_sizes``)."""
    rows, _, _ = q.shape
    _, slots, features = keys.shape
    grid = plan_grid(q, keys, q_positions, k_positions, window, block_slots)
    out = pl.pallas_call(
        functools.partial(_attention_kernel, scale=scale, softcap=softcap, window=window),
        out_shape=jax.ShapeDtypeStruct(grid.q_flat.shape, jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid.shape, in_specs=grid.in_specs(features),
            out_specs=grid.row_spec(*grid.q_flat.shape[1:]), scratch_shapes=grid.scratch(),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(grid.lo, grid.hi, grid.q_flat, q_positions.astype(jnp.int32).reshape(rows, 1, 1),
      k_positions.astype(jnp.int32).reshape(rows, 1, slots), keys, values)
    return own_heads(out, grid, q)
