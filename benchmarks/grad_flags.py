"""The learner's grad step under compiler flags and splash block sizes (issue 51, item 2).

    python3 benchmarks/grad_flags.py MANIFEST... [--variant NAME=REMAT/BLOCKS/LIBTPU_ARGS ...]
        [--set learner.optimizerStateDtype=bfloat16 ...] [--repeats 5] [--timeout 150] [--json OUT.json]

Each (manifest, variant) is one ``stoker bench MANIFEST --programs grad`` in its own process (a
process holds the chip, and libtpu reads ``LIBTPU_INIT_ARGS`` once, at start), with
``model.remat`` set to REMAT (``-``: the manifest's), splash's block table replaced by BLOCKS
(``1024,512``; ``-``: the shipped ``SPLASH_BLOCKS``) and LIBTPU_ARGS (``-``: none) in the
environment; each ``--set`` (a spec path) applies to every run. Prints a line per run (median ms, MFU, peak GiB, compile s) and a markdown table.
Meant for the lent TPU (``benchmarks/chip.sh flags``); on the CPU it runs, but MFU is n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from local_runs import manifest_variant, set_path

DEFAULT_VARIANTS = [
    "full=full/-/-",
    "none=none/-/-",
    "none-vmem=none/-/--xla_tpu_scoped_vmem_limit_kib=98304",
    "none-2048=none/2048,1024,512,256,128/--xla_tpu_scoped_vmem_limit_kib=98304",
    "full-vmem=full/-/--xla_tpu_scoped_vmem_limit_kib=98304",
]

# Runs in the child: the block table replaced before anything is traced, then the CLI's bench.
CHILD = """
import sys
blocks = sys.argv[1]
if blocks != "-":
    from stoker.model import attention_kernels
    attention_kernels.SPLASH_BLOCKS = tuple(int(b) for b in blocks.split(","))
from stoker.cli import main
sys.exit(main(sys.argv[2:]))
"""


def variant(text: str) -> tuple[str, str, str, str]:
    name, _, rest = text.partition("=")
    parts = rest.split("/", 2)
    if not name or len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=REMAT/BLOCKS/LIBTPU_ARGS ('-' for the default)")
    return name, parts[0], parts[1], parts[2]


def edited(manifest: Path, remat: str, sets: list[str], where: Path) -> Path:
    def edit(doc: dict[str, Any]) -> None:
        for item in sets + ([f"model.remat={remat}"] if remat != "-" else []):
            set_path(doc, *item.split("=", 1))

    return manifest_variant(manifest, where / f"{manifest.stem}-{remat}.yaml", edit)


def run_one(manifest: Path, name: str, remat: str, blocks: str, flags: str, sets: list[str], repeats: int,
            timeout: float, where: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("LIBTPU_INIT_ARGS", None)
    if flags != "-":
        env["LIBTPU_INIT_ARGS"] = flags
    job = edited(manifest, remat, sets, where)
    command = [sys.executable, "-c", CHILD, blocks, "bench", str(job), "--programs", "grad", "--repeats", str(repeats),
               "--program-timeout", str(int(timeout)), "--json"]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout + 30, cwd=where)
    except subprocess.TimeoutExpired:
        return {"manifest": manifest.stem, "variant": name, "error": f"no answer in {timeout + 30:.0f} s"}
    wall = time.perf_counter() - started
    result: dict[str, Any] = {"manifest": manifest.stem, "variant": name, "remat": remat, "blocks": blocks,
                              "libtpu_args": flags, "wall_s": round(wall, 1), "exit": done.returncode}
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        result["error"] = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return result
    rows = [r for r in report.get("programs", []) if str(r.get("program", "")).startswith("grad")]
    if not rows:
        result["error"] = "no grad row"
        return result
    row = rows[0]
    result.update({k: row.get(k) for k in ("seconds", "mfu", "peak_bytes_per_device", "compile_seconds", "status", "reason")})
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| manifest | variant | median | MFU | peak | compile | wall |", "|---|---|---|---|---|---|---|"]
    for r in results:
        median = f"{r['seconds'] * 1e3:.1f} ms" if r.get("seconds") else r.get("error") or r.get("status") or "–"
        mfu = f"{r['mfu'] * 100:.1f} %" if r.get("mfu") else "n/a"
        peak = f"{r['peak_bytes_per_device'] / 2**30:.2f} GiB" if r.get("peak_bytes_per_device") else "n/a"
        compile_s = f"{r['compile_seconds']:.1f} s" if r.get("compile_seconds") else "–"
        lines.append(f"| {r['manifest']} | {r['variant']} | {median} | {mfu} | {peak} | {compile_s} | {r.get('wall_s', '–')} s |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifests", type=Path, nargs="+")
    parser.add_argument("--variant", type=variant, action="append", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="a spec override for every run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds a run may take, compiles included")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = args.variant or [variant(v) for v in DEFAULT_VARIANTS]
    results = []
    with tempfile.TemporaryDirectory() as where:
        for manifest in args.manifests:
            for name, remat, blocks, flags in variants:
                result = run_one(manifest.resolve(), name, remat, blocks, flags, args.set, args.repeats, args.timeout, Path(where))
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.json is not None:
                    args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
