"""Where the sampler's decode call spends its device time, op by op (issue 52).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/decode_profile.py 128 256 --out $OUT

The sampler of ``sampler_decode.py`` (Qwen2.5-0.5B shape, bf16, 128-token prompts, 128 new
tokens): the call's decode rate as ``sampler_decode.py`` times it, then one call traced by JAX's
profiler, the device's "XLA Ops" events summed by op kind and result type, per decode step.
Prints a JSON line and a table per batch size; the table also goes to ``--out`` (profile-B.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from sampler_decode import NEW, PROMPT, QWEN_05B, decode_rate
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


CONTAINERS = ("while", "conditional", "call")  # their time is their ops' time, counted there


def signature(name: str) -> tuple[str, str]:
    """(opcode, result type without layouts) of an op's HLO text: ``%fusion.5 = f32[8,16]{1,0} fusion(...)``."""
    match = re.match(r"%?[\w.\-]+ = (.+?) ([\w\-]+)\(", name)
    if match is None:
        return name[:40], ""
    return match.group(2), re.sub(r"\{[^}]*\}", "", match.group(1))[:90]


def table(ops: list[tuple[str, float, dict[str, object]]], steps: int, top: int) -> str:
    """Device time a decode step by op kind and result type (the 24 layers' kernels add up in one
    line), containers left out."""
    by_kind: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for name, us, _ in ops:
        opcode, result = signature(name)
        if opcode not in CONTAINERS:
            by_kind[(opcode, result)].append(us)
    total = sum(sum(times) for times in by_kind.values())
    lines = [f"device time outside containers {total / steps:.1f} us a decode step ({steps} steps)", ""]
    lines += ["| op | result | count a step | us a step | share |", "|---|---|---|---|---|"]
    for (opcode, result), times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {opcode} | `{result}` | {len(times) / steps:.1f} | {sum(times) / steps:.1f} | {sum(times) / total:.1%} |")
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
        rate = decode_rate(sampler, prompts, repeats=2)  # compiles, then times the call untraced
        print(json.dumps({"batch": batch, "decode_kernels": args.decode_kernels == "on", **rate}), flush=True)
        with tempfile.TemporaryDirectory() as trace_dir:
            start = time.perf_counter()
            with jax.profiler.trace(trace_dir):
                sampler.generate(prompts, max_new_tokens=NEW)
            wall = time.perf_counter() - start
            text = (f"## batch {batch}, decode kernels {args.decode_kernels}: {rate['decode_tokens_per_s']} decode tokens/s "
                    f"({rate['of_bound']:.0%} of the bound); the traced call {wall * 1e3:.1f} ms\n\n")
            text += table(device_ops(trace_dir), NEW - 1, args.top)
        print(text, flush=True)
        (args.out / f"profile-{batch}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
