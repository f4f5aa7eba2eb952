"""Learner train-step throughput: bucketed packing vs naive padding to the longest sequence.

Both arms run the same jitted GRPO train step (``stoker.learner.train.Trainer``) on the same
batches, drawn from a realistic agentic length mix (many short episodes, a few long ones):

* packed: first-fit-decreasing into fixed ``[rows, bucket]`` micro-batches (one program per bucket);
* naive:  one episode per row, every row padded to the batch's longest episode (a new program
  whenever that length is new).

Reported per arm: useful (non-pad) tokens/s over all steps (compiles included, what a run pays) and
with the time spent tracing, lowering and compiling subtracted (execution only; the naive arm
compiles on almost every step, so it has no compile-free steps to time), padding waste, XLA
compilations; and the ratios.
With ``--peak-tflops`` it also reports MFU from the FLOPs estimate

    FLOPs/step = 6 N tokens + 6 L d_attn sum_i n_i^2

(N = parameters taking part in matmuls; the second term is causal attention within each packed
sequence i of n_i tokens, forward + backward: QK^T and AV at 2 d_attn n_i^2 / 2 each, x3).

    .venv/bin/python benchmarks/learner_throughput.py                       # CPU, tiny model
    python benchmarks/learner_throughput.py --config 1b --dtype bfloat16 --peak-tflops 989
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CONFIGS = {
    # ~0.7M parameters: a CPU-sized stand-in with the same structure.
    "tiny": dict(vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=384, max_seq_len=2048),
    # ~1.0B parameters (20 x 47M per block + 66M tied embedding), Llama-3.2-1B class.
    "1b": dict(vocab_size=32000, hidden_size=2048, num_layers=20, num_heads=16, num_kv_heads=8,
               intermediate_size=5632, max_seq_len=4096),
}


def length_mix(rng: np.random.Generator, episodes: int, long_fraction: float, short: tuple[int, int],
               long: tuple[int, int]) -> list[int]:
    """Mostly short episodes (uniform in ``short``), a ``long_fraction`` of long ones."""
    is_long = rng.random(episodes) < long_fraction
    return [int(rng.integers(*long)) if big else int(rng.integers(*short)) for big in is_long]


def make_sequences(rng: np.random.Generator, lengths: list[int], vocab: int) -> list:
    from stoker.learner.packing import TrainSequence

    out = []
    for n in lengths:
        ids = rng.integers(0, vocab, n).astype(np.int32)
        mask = np.zeros(n, np.uint8)
        mask[n // 4 :] = (rng.random(n - n // 4) < 0.8)  # prompt, then mostly model tokens
        out.append(TrainSequence(ids, mask, np.where(mask, -1.0, 0.0).astype(np.float32),
                                 np.where(mask, 0, -1).astype(np.int32), advantage=float(rng.normal())))
    return out


@dataclass
class Arm:
    name: str
    steps: int = 0
    seconds: float = 0.0
    exec_seconds: float = 0.0
    useful_tokens: int = 0
    total_tokens: int = 0
    attention_sq: float = 0.0
    compilations: int = 0
    compiled: dict[str, int] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    def report(self, flops_per_token: float, attn_coeff: float, peak_tflops: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps": self.steps,
            "useful_tokens_per_s": self.useful_tokens / self.seconds,
            "exec_useful_tokens_per_s": self.useful_tokens / self.exec_seconds,
            "padding_waste": 1 - self.useful_tokens / self.total_tokens,
            "compilations": self.compilations,
            "compiled_functions": self.compiled,
            "seconds": self.seconds,
        }
        if peak_tflops:
            flops = flops_per_token * self.useful_tokens + attn_coeff * self.attention_sq
            out["mfu"] = flops / self.seconds / (peak_tflops * 1e12)
            out["exec_mfu"] = flops / self.exec_seconds / (peak_tflops * 1e12)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=12, help="train steps per arm")
    parser.add_argument("--episodes", type=int, default=32, help="episodes per batch")
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--short", type=int, nargs=2, default=(24, 160), metavar=("MIN", "MAX"))
    parser.add_argument("--long", type=int, nargs=2, default=(400, 1000), metavar=("MIN", "MAX"))
    parser.add_argument("--buckets", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--microbatch-tokens", type=int, default=4096)
    parser.add_argument("--peak-tflops", type=float, default=None, help="accelerator peak for MFU (e.g. 989 H100 bf16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = parser.parse_args(argv)

    import jax

    from stoker.learner import packing, sharding, train
    from stoker.model import hf
    from stoker.learner.algorithms import LossConfig
    from stoker.learner.metrics import CompileCounter
    from stoker.model.model import count_params, init_model
    from stoker.spec import TransformerConfig

    config = TransformerConfig(**CONFIGS[args.config])
    dtype = hf.dtype_from_name(args.dtype)
    counter = CompileCounter.install()
    mesh = sharding.make_mesh()
    rng = np.random.default_rng(args.seed)
    batches = [
        make_sequences(rng, length_mix(rng, args.episodes, args.long_fraction, tuple(args.short), tuple(args.long)),
                       config.vocab_size)
        for _ in range(args.steps)
    ]
    longest = max(args.buckets)
    batches = [[packing.truncate(s, longest) for s in batch] for batch in batches]
    rows = packing.rows_for_buckets(args.buckets, args.microbatch_tokens, sharding.data_parallel_size(mesh))

    model = init_model(config, args.seed, dtype)
    n_params = count_params(model)
    if not config.tie_embeddings:
        n_params -= config.vocab_size * config.hidden_size  # the input lookup does no matmul
    d_attn = config.num_heads * (config.head_dim or config.hidden_size // config.num_heads)
    flops_per_token = 6.0 * n_params
    attn_coeff = 6.0 * config.num_layers * d_attn

    arms = []
    for name in ("packed", "naive"):
        trainer = train.Trainer(init_model(config, args.seed, dtype), train.StepOptions("grpo", LossConfig()),
                                train.make_optimizer(1e-5, 1.0), mesh)
        arm = Arm(name)
        by_function_before = dict(counter.by_function)
        for batch in batches:
            micros = (packing.pack([[s] for s in batch], args.buckets, rows) if name == "packed"
                      else [packing.pad_to_longest(batch)])
            train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
            before = counter.count
            compile_before = counter.seconds + counter.frontend_seconds
            started = time.perf_counter()
            trainer.step(micros, 0)  # returns host floats: the step has finished
            jax.block_until_ready(trainer.params)
            elapsed = time.perf_counter() - started
            compiled = counter.count - before
            useful = sum(m.real_tokens for m in micros)
            arm.steps += 1
            arm.seconds += elapsed
            arm.useful_tokens += useful
            arm.total_tokens += sum(m.total_tokens for m in micros)
            arm.attention_sq += float(sum(len(s) ** 2 for s in batch))
            arm.compilations += compiled
            arm.step_times.append(elapsed)
            arm.exec_seconds += max(elapsed - (counter.seconds + counter.frontend_seconds - compile_before), 1e-9)
        arm.compiled = {k: v - by_function_before.get(k, 0) for k, v in counter.by_function.items()
                        if v > by_function_before.get(k, 0)}
        arms.append(arm)

    reports = {arm.name: arm.report(flops_per_token, attn_coeff, args.peak_tflops) for arm in arms}
    packed, naive = reports["packed"], reports["naive"]
    summary = {
        "config": args.config, "dtype": args.dtype, "params": n_params, "device": str(jax.devices()[0].platform),
        "episodes_per_batch": args.episodes, "steps": args.steps, "buckets": args.buckets,
        "mean_episode_len": float(np.mean([len(s) for b in batches for s in b])),
        "packed": packed, "naive": naive,
        "ratio_useful_tokens_per_s": packed["useful_tokens_per_s"] / naive["useful_tokens_per_s"],
        "ratio_exec_useful_tokens_per_s": packed["exec_useful_tokens_per_s"] / naive["exec_useful_tokens_per_s"],
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"{args.config} ({n_params / 1e6:.1f}M params, {args.dtype}) on {summary['device']}; "
          f"{args.steps} batches of {args.episodes} episodes, mean length {summary['mean_episode_len']:.0f}")
    print(f"{'arm':8} {'useful tok/s':>13} {'exec tok/s':>13} {'pad waste':>10} {'compiles':>9}"
          + ("  MFU" if args.peak_tflops else ""))
    for name, r in reports.items():
        mfu = f"  {r['mfu']:.1%} ({r['exec_mfu']:.1%} exec)" if args.peak_tflops else ""
        print(f"{name:8} {r['useful_tokens_per_s']:13.0f} {r['exec_useful_tokens_per_s']:13.0f} "
              f"{r['padding_waste']:10.1%} {r['compilations']:9d}{mfu}")
    print(f"packed / naive useful tokens/s: {summary['ratio_useful_tokens_per_s']:.2f}x overall, "
          f"{summary['ratio_exec_useful_tokens_per_s']:.2f}x execution only")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
