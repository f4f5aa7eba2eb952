"""The in-process sampler's decode rate on the chip, on the decode kernels and off (issue 52).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && python3 benchmarks/sampler_decode.py 8 32 128 256

A ``Sampler`` of the Qwen2.5-0.5B shape in bfloat16 (random weights), prompts of 128 random
tokens, 128 new tokens sampled at temperature 1 with no stop token; decode alone is the whole
call minus a 1-token call with the same prompts (issue 52's measure), each the best of
``--repeats``. Prints one JSON line per batch size and variant: decode tokens/s and its share of
the attainable bound (every weight plus each row's keys and values at the mean context of 192
tokens read once per step at 819 GB/s).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig

QWEN_05B = TransformerConfig(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                             intermediate_size=4864, max_seq_len=8192, rope_theta=1e6, tie_embeddings=True,
                             attention_bias=True)
HBM_BYTES_PER_SECOND = 819e9  # TPU v5e
PROMPT, NEW = 128, 128


def best_seconds(sampler: Sampler, prompts: list[list[int]], new: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.generate(prompts, max_new_tokens=new)
        times.append(time.perf_counter() - start)
    return min(times)


def decode_rate(sampler: Sampler, prompts: list[list[int]], repeats: int) -> dict[str, float]:
    """Decode tokens/s of ``prompts`` (the whole call minus a 1-token call) and its share of the
    bound; the sampler's program compiled first."""
    batch = len(prompts)
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(sampler._state))
    compile_start = time.perf_counter()
    sampler.generate(prompts, max_new_tokens=1)  # compiles the call's program
    compiled = time.perf_counter() - compile_start
    one = best_seconds(sampler, prompts, 1, repeats)
    whole = best_seconds(sampler, prompts, NEW, repeats)
    rate = batch * (NEW - 1) / (whole - one)
    kv = 2 * QWEN_05B.num_layers * batch * (PROMPT + NEW // 2) * QWEN_05B.num_kv_heads * 64 * 2
    bound = batch / ((weights + kv) / HBM_BYTES_PER_SECOND)
    return {"decode_tokens_per_s": round(rate), "of_bound": round(rate / bound, 2), "one_token_call_ms": round(one * 1e3, 1),
            "first_call_s": round(compiled, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("batches", type=int, nargs="*", default=[8, 128])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", choices=("both", "on", "off"), default="both", help="decode kernels on, off or both")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for kernels in {"both": (True, False), "on": (True,), "off": (False,)}[args.kernels]:
        sampler = Sampler(QWEN_05B, SamplingSpec(temperature=1.0), seed=0, buckets=(128, 256), dtype=jnp.bfloat16,
                          decode_kernels=kernels)
        for batch in args.batches:
            prompts = [rng.integers(0, QWEN_05B.vocab_size, PROMPT).tolist() for _ in range(batch)]
            print(json.dumps({"batch": batch, "decode_kernels": kernels, **decode_rate(sampler, prompts, args.repeats)}), flush=True)


if __name__ == "__main__":
    main()
