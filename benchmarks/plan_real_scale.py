"""`stoker plan` at real scale: Llama-3-70B, Llama-3-8B, Qwen2.5-7B and Qwen3-30B-A3B GRPO learners at 8,192 tokens,
compiled by libtpu for the slices they would train on, on this CPU machine (no TPU).

    .venv/bin/python benchmarks/plan_real_scale.py [--only NAME ...] [--dtype bfloat16] [--sequence-sharding]
        [--weight-dtype bfloat16] [--optimizer-state-dtype bfloat16] [--json OUT]

Each case is a manifest run through `stoker plan`'s own code (every program: grad at the 8,192-token
bucket, one row per fsdp shard; apply; publish). Prints one markdown row per case: GiB per chip by
term of the largest program, the verdict, the step-time and MFU bounds, and the compile time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

LLAMA3_70B = ("{vocabSize: 128256, hiddenSize: 8192, numLayers: 80, numHeads: 64, numKvHeads: 8, "
              "intermediateSize: 28672, maxSeqLen: 8192, ropeTheta: 500000.0, tieEmbeddings: false}")
LLAMA3_8B = ("{vocabSize: 128256, hiddenSize: 4096, numLayers: 32, numHeads: 32, numKvHeads: 8, "
             "intermediateSize: 14336, maxSeqLen: 8192, ropeTheta: 500000.0, tieEmbeddings: false}")
QWEN25_7B = ("{vocabSize: 152064, hiddenSize: 3584, numLayers: 28, numHeads: 28, numKvHeads: 4, "
             "intermediateSize: 18944, maxSeqLen: 8192, ropeTheta: 1000000.0, tieEmbeddings: false, attentionBias: true}")

# The mixture of experts of issue 45: 128 experts of width 768, top-8, every layer sparse.
QWEN3_30B_A3B = ("{vocabSize: 151936, hiddenSize: 2048, numLayers: 48, numHeads: 32, numKvHeads: 4, headDim: 128, "
                 "intermediateSize: 6144, maxSeqLen: 8192, ropeTheta: 1000000.0, tieEmbeddings: false, qkNorm: true, "
                 "numExperts: 128, numExpertsPerTok: 8, moeIntermediateSize: 768, normTopkProb: true}")

# name -> (architecture, GKE accelerator, topology, fsdp, tp, attention[, ep, expertCapacityFactor])
CASES: dict[str, tuple] = {
    "llama3-70b-v5p-128": (LLAMA3_70B, "tpu-v5p-slice", "4x4x4", 16, 4, "blockwise"),
    "llama3-70b-v6e-256": (LLAMA3_70B, "tpu-v6e-slice", "16x16", 64, 4, "blockwise"),
    "llama3-8b-v6e-16": (LLAMA3_8B, "tpu-v6e-slice", "4x4", 4, 4, "blockwise"),
    "qwen2.5-7b-v6e-16": (QWEN25_7B, "tpu-v6e-slice", "4x4", 4, 4, "blockwise"),
    "qwen3-30b-a3b-v5p-128": (QWEN3_30B_A3B, "tpu-v5p-slice", "4x4x4", 16, 1, "splash", 4, 1.25),
    "qwen3-30b-a3b-v6e-64": (QWEN3_30B_A3B, "tpu-v6e-slice", "8x8", 16, 1, "splash", 4, 1.25),
    "qwen3-30b-a3b-v6e-32": (QWEN3_30B_A3B, "tpu-v6e-slice", "4x8", 8, 1, "splash", 4, 1.25),
    # The same v5p-128 step without an expert axis (every chip a slice of every expert), and
    # without a capacity (every expert on every token): what ep and the capacity buy.
    "qwen3-30b-a3b-v5p-128-ep1": (QWEN3_30B_A3B, "tpu-v5p-slice", "4x4x4", 64, 1, "splash", 1, 1.25),
    "qwen3-30b-a3b-v5p-128-nocap": (QWEN3_30B_A3B, "tpu-v5p-slice", "4x4x4", 16, 1, "splash", 4, None),
}

MANIFEST = """\
apiVersion: stoker.dev/v1alpha1
kind: RLJob
metadata: {{name: plan}}
spec:
  model: {{architecture: {arch}, dtype: {dtype}, remat: full, attention: {attention}}}
  environment: {{name: frozenlake, maxTurns: 3}}
  buffer: {{groupSize: 8}}
  learner:
    accelerator: {accelerator}
    topology: "{topology}"
    mesh: {{fsdp: {fsdp}, ep: {ep}, tp: {tp}, sequenceSharding: {sequence_sharding}{capacity}}}
    weightDtype: {weight_dtype}
    optimizerStateDtype: {state_dtype}
    batchGroups: 4
    sequenceBuckets: [8192]
    microbatchTokens: {tokens}
"""


def run(name: str, directory: Path, dtype: str = "float32", sequence_sharding: bool = False,
        weight_dtype: str = "float32", state_dtype: str = "float32") -> dict:
    from stoker.manifest import load_job
    from stoker.sizing.plan import build, report, targets

    arch, accelerator, topology, fsdp, tp, attention, *experts = CASES[name]
    ep, factor = experts or (1, None)
    path = directory / f"{name}.yaml"
    path.write_text(MANIFEST.format(arch=arch, accelerator=accelerator, topology=topology, fsdp=fsdp, tp=tp, ep=ep,
                                    capacity="" if factor is None else f", expertCapacityFactor: {factor}",
                                    attention=attention, tokens=8192 * fsdp * ep, dtype=dtype,
                                    sequence_sharding=str(sequence_sharding).lower(), weight_dtype=weight_dtype,
                                    state_dtype=state_dtype))
    spec = load_job(str(path)).spec
    plan_targets, notes = targets(spec, None)
    started = time.perf_counter()
    build(spec, plan_targets, lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True))
    result = report(spec, plan_targets, notes)
    result["case"], result["seconds"] = name, time.perf_counter() - started
    stored = "".join(f", {what} {name}" for what, name in (("weights", weight_dtype), ("Adam state", state_dtype))
                     if name != "float32")
    result["knobs"] = f"{dtype}{', sequence sharding' if sequence_sharding else ''}{stored}"
    return result


def row(result: dict) -> str:
    gib = 2**30
    grad = next(p for p in result["programs"] if p["program"].startswith("grad"))
    terms = grad["terms"]
    cell = lambda k: f"{terms.get(k, 0) / gib:.2f}"  # noqa: E731
    learner = result.get("learner", {})
    verdict = "fits" if all(p["fits"] for p in result["programs"]) else "DOES NOT FIT"
    refused = " (compiler refused: " + grad["compiler_error"] + ")" if grad["compiler_error"] else ""
    return (f"| {result['case']} | {result['knobs']} | {cell('parameters')} | {cell('optimizer')} | {cell('gradients')} | "
            f"{cell('publish copy')} | {cell('temporaries')} | {grad['total_bytes'] / gib:.2f} / {grad['hbm_bytes'] / gib:.0f} | {verdict}{refused} | "
            f"{learner.get('step_seconds_bound', 0):.2f} | {learner.get('mfu_bound', 0):.0%} | "
            f"{grad['compile_seconds']:.0f} | {result['seconds']:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases to run (default: all)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype (compute)")
    parser.add_argument("--sequence-sharding", action="store_true", help="learner.mesh.sequenceSharding: true")
    parser.add_argument("--weight-dtype", choices=["float32", "bfloat16"], default="float32", help="learner.weightDtype")
    parser.add_argument("--optimizer-state-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="learner.optimizerStateDtype")
    parser.add_argument("--json", metavar="OUT", help="also write every result as JSON here")
    args = parser.parse_args()
    print("| case | knobs | params | optimizer | gradients | publish copy | temporaries | grad total / HBM GiB | verdict "
          "| step >= s | MFU <= | grad compile s | all programs s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for name in args.only or list(CASES):
            result = run(name, Path(directory), args.dtype, args.sequence_sharding, args.weight_dtype,
                         args.optimizer_state_dtype)
            results.append(result)
            print(row(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
