"""Where the sampler's decode call spends its device time, op by op (issue 52).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/decode_profile.py 128 256 --out $OUT

The sampler of ``sampler_decode.py`` (Qwen2.5-0.5B shape, bf16, 128-token prompts, 128 new
tokens), one whole call traced by JAX's profiler after a warm-up call; the device's "XLA Ops"
events are summed by op and by the JAX name stack they came from, per decode token. Prints a table
per batch size and writes it to ``--out`` (profile-B.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from sampler_decode import NEW, PROMPT, QWEN_05B
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec


def device_ops(trace_dir: str) -> list[tuple[str, float, dict[str, object]]]:
    """(op name, microseconds, stats) of every op the TPU ran in the trace (on a CPU, of every
    thunk XLA's CPU runtime ran: a check of the script, not a measure)."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    tpu, cpu = [], []
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                op = (event.name, event.duration_ns / 1e3, dict(event.stats))
                if plane.name.startswith("/device:TPU") and line.name == "XLA Ops":
                    tpu.append(op)
                elif plane.name == "/host:CPU" and "hlo_op" in op[2]:
                    cpu.append(op)
    return tpu or cpu


def source(stats: dict[str, object]) -> str:
    """The JAX name stack an op came from, without the jit/while wrappers (the model's modules)."""
    stack = str(stats.get("tf_op") or stats.get("name") or "?")
    parts = [p for p in stack.split("/") if not p.startswith(("jit(", "while", "body", "cond", "closed_call", "pjit"))]
    return "/".join(parts[:4]) or stack


def table(ops: list[tuple[str, float, dict[str, object]]], steps: int, top: int) -> str:
    total = sum(us for _, us, _ in ops)
    by_source: dict[str, float] = collections.defaultdict(float)
    by_category: dict[str, float] = collections.defaultdict(float)
    by_op: dict[str, list[float]] = collections.defaultdict(list)
    for name, us, stats in ops:
        by_source[source(stats)] += us
        by_category[str(stats.get("hlo_category", "?"))] += us
        by_op[name].append(us)
    lines = [f"device time {total / 1e3:.2f} ms, {total / steps:.1f} us a decode step ({steps} steps)", ""]
    lines += ["| category | us a step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / steps:.1f} | {v / total:.1%} |" for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])]
    lines += ["", "| source | us a step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v / steps:.1f} | {v / total:.1%} |" for k, v in sorted(by_source.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", "| op | count | us a step | share | source |", "|---|---|---|---|---|"]
    example = {name: stats for name, _, stats in ops}
    for name, times in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {name} | {len(times)} | {sum(times) / steps:.1f} | {sum(times) / total:.1%} | {source(example[name])} |")
    keys = sorted({k for _, _, stats in ops[:50] for k in stats})
    lines += ["", f"stats of an op: {keys}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("batches", type=int, nargs="*", default=[128])
    parser.add_argument("--decode-kernels", choices=("on", "off"), default="on")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sampler = Sampler(QWEN_05B, SamplingSpec(temperature=1.0), seed=0, buckets=(128, 256), dtype=jnp.bfloat16,
                      decode_kernels=args.decode_kernels == "on")
    for batch in args.batches:
        prompts = [rng.integers(0, QWEN_05B.vocab_size, PROMPT).tolist() for _ in range(batch)]
        sampler.generate(prompts, max_new_tokens=NEW)  # compiles
        with tempfile.TemporaryDirectory() as trace_dir:
            start = time.perf_counter()
            with jax.profiler.trace(trace_dir):
                sampler.generate(prompts, max_new_tokens=NEW)
            wall = time.perf_counter() - start
            text = f"## batch {batch}, decode kernels {args.decode_kernels}, call {wall * 1e3:.1f} ms (traced)\n\n"
            text += table(device_ops(trace_dir), NEW - 1, args.top)
        print(text, flush=True)
        (args.out / f"profile-{batch}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
