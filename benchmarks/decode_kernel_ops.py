"""The decode kernels' operations as libtpu compiles them for the v5e, on this CPU (issue 52).

    .venv/bin/python benchmarks/decode_kernel_ops.py [--rows 128] [--options '{"word_view": true}']

Compiles ``ragged_decode_attention`` (Qwen2.5-0.5B's attention shape: 14 query heads, 2 kv heads
of 64, a [rows, 256, 128] bfloat16 cache) and ``write_rows`` for one v5e chip with Mosaic's dump
on (``--xla_mosaic_dump_to``), and counts the operations of each kernel's final LLO, by kind. The
kernels issue about one operation a cycle, so the count tracks their time where the HBM does not
bound it (benchmarks/README.md, "Where the decode call's time goes": 4,805 operations a block of
8 rows against its measured 3.1 us). ``--options``: keyword arguments of the attention (JSON).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SLOTS, FEATURES, HEADS, DIM = 256, 128, 14, 64


def compile_kernel(kernel: str, rows: int, options: dict[str, object]) -> None:
    """Runs in a child process: libtpu reads its flags once, at start."""
    import jax
    import jax.numpy as jnp

    from stoker.model.decode_attention import ragged_decode_attention, write_rows
    from stoker.sizing.compiler import load_slice

    placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])

    def shaped(shape: tuple[int, ...], dtype: object = jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    cache = shaped((rows, SLOTS, FEATURES))
    if kernel == "write":
        jax.jit(write_rows, donate_argnums=(0, 1)).lower(
            cache, cache, shaped((rows, FEATURES)), shaped((rows, FEATURES)), shaped((rows,), jnp.int32)
        ).compile()
    else:
        attend = jax.jit(lambda q, k, v, qp, kp: ragged_decode_attention(q, k, v, qp, kp, scale=DIM**-0.5, **options))
        attend.lower(shaped((rows, HEADS, DIM)), cache, cache, shaped((rows,), jnp.int32),
                     shaped((rows, SLOTS), jnp.int32)).compile()


def count(kernel: str, rows: int, options: dict[str, object]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} --xla_mosaic_dump_to={dump}"}
        subprocess.run([sys.executable, __file__, "--child", kernel, "--rows", str(rows), "--options", json.dumps(options)],
                       env=env, check=True, capture_output=True)
        final = sorted(Path(dump).glob("*-finalize-llo.txt"), key=lambda p: p.stat().st_mtime)[-1]
        ops = collections.Counter(re.findall(r"llo\.[a-z_0-9.]+", final.read_text()))
    for skipped in ("llo.type", "llo.constant"):  # declarations, not operations
        ops.pop(skipped, None)
    return {"kernel": kernel, "rows": rows, "options": options, "llo_operations": sum(ops.values()),
            "by_kind": dict(ops.most_common(8))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--options", default="{}", help="the attention's keyword arguments, JSON")
    parser.add_argument("--child", choices=("attention", "write"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = json.loads(args.options)
    if args.child:
        compile_kernel(args.child, args.rows, options)
        return
    for kernel in ("attention", "write"):
        print(json.dumps(count(kernel, args.rows, options if kernel == "attention" else {})), flush=True)


if __name__ == "__main__":
    main()
