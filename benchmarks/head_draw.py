"""The LM head fused with the draw against the two apart, in whole sampler calls (issue 52).

    device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && cd benchmarks && python3 head_draw.py 8 32 64

``sampler_decode.py``'s measure (Qwen2.5-0.5B shape, bf16, 128-token prompts, 128 new tokens,
decode alone) for each batch size twice, side by side: the head's matmul fused into the draw's
reduction (``HEAD_FUSED_MIN_ROWS`` at 0) and kept apart by an optimization barrier (at a
batch past the largest). One JSON line each; ``HEAD_FUSED_MIN_ROWS`` is set from them.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from sampler_decode import PROMPT, QWEN_05B, decode_rate
from stoker.rollout import programs
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("batches", type=int, nargs="*", default=[8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for batch in args.batches:
        prompts = [rng.integers(0, QWEN_05B.vocab_size, PROMPT).tolist() for _ in range(batch)]
        for fused in (True, False):
            programs.HEAD_FUSED_MIN_ROWS = 0 if fused else batch + 1  # read when the loop is traced
            sampler = Sampler(QWEN_05B, SamplingSpec(temperature=1.0), seed=0, buckets=(128, 256), dtype=jnp.bfloat16)
            rate = decode_rate(sampler, prompts, args.repeats)
            print(json.dumps({"batch": batch, "head": "fused with the draw" if fused else "apart", **rate}), flush=True)


if __name__ == "__main__":
    main()
