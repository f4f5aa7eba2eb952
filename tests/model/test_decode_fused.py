"""The cache write inside the attention kernel (``stoker.model.decode_fused``, issue 52) in Pallas'
interpreter against the two kernels it joins (``write_rows`` then ``ragged_decode_attention``):
the same output and the same caches, every other slot untouched; and compiled for the v5e by libtpu
here, one Mosaic kernel that copies no cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.decode_attention import key_positions, ragged_decode_attention, write_rows
from stoker.model.decode_fused import attend_and_write

ROWS, SLOTS, KV_HEADS, DIM, HEADS = 16, 256, 2, 8, 6
# Two groups of 8 rows, blocks of 128 slots: new slots in either block, at a tile's first and last
# slot, at the cache's last slot, and two outside the cache (written nowhere).
POSITIONS = [5, 60, 127, 3, 100, 90, 16, 15, 200, 128, 255, 129, 17, SLOTS, 240, SLOTS + 40]


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (40, 3.0)])
@pytest.mark.parametrize("jit", [False, True])
def test_one_kernel_writes_and_attends_as_the_two(window: int | None, softcap: float | None, jit: bool) -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(ROWS, HEADS, DIM)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(ROWS, SLOTS, KV_HEADS * DIM)), jnp.float32) for _ in range(2))
    new_keys, new_values = (jnp.asarray(rng.normal(size=(ROWS, KV_HEADS * DIM)), jnp.float32) for _ in range(2))
    positions = jnp.asarray(POSITIONS, jnp.int32)
    index = jnp.broadcast_to(jnp.arange(SLOTS, dtype=jnp.int32), (ROWS, SLOTS))
    k_positions = key_positions((index <= positions[:, None]).astype(jnp.int32), index)
    options = {"scale": 0.3, "softcap": softcap, "window": window, "interpret": True, "block_slots": 128}
    want_k, want_v = write_rows(keys, values, new_keys, new_values, positions, interpret=True)
    want = ragged_decode_attention(q, want_k, want_v, positions, k_positions, **options)

    def fused(*args: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return attend_and_write(*args, **options)

    out, got_k, got_v = (jax.jit(fused) if jit else fused)(q, keys, values, new_keys, new_values, positions, k_positions)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    changed = np.asarray(got_k != keys).any(-1)
    assert changed.sum() == ROWS - 2 and not changed[[13, 15]].any()  # one slot a row inside the cache


def test_on_the_v5e_it_is_one_mosaic_kernel_that_copies_no_cache() -> None:
    from stoker.sizing.compiler import load_slice

    placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])

    def spec(shape: tuple[int, ...], dtype: jnp.dtype = jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    rows, slots, features = 128, 256, 128
    step = jax.jit(lambda *a: attend_and_write(*a, scale=0.125), donate_argnums=(1, 2))
    text = step.lower(spec((rows, 14, 64)), spec((rows, slots, features)), spec((rows, slots, features)),
                      spec((rows, features)), spec((rows, features)), spec((rows,), jnp.int32),
                      spec((rows, slots), jnp.int32)).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 1
    assert f"bf16[{rows},{slots},{features}]" not in "".join(l for l in text.splitlines() if " copy(" in l or "copy-start(" in l)
