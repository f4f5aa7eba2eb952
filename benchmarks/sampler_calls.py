"""The actor's sampler calls: how many rows each carries, and prefixes shared between conversations.

    .venv/bin/python benchmarks/sampler_calls.py [--manifest examples/frozenlake.yaml]
        [--concurrency 256] [--latency 0.5] [--swap-seconds 2.5] [--groups 64] [--rounds 3]

One actor's episode loop as ``stoker actor`` builds it from the manifest (``make_policy``), with
inline FrozenLake environments, ``--latency`` seconds per environment step and weights swapped every
``--swap-seconds`` (the utilisation benchmark's setting: many episodes in flight, each turn
arriving on its own, and a swap sending running conversations back to a full prefill). At this
concurrency the episode rate is set by the latency; the figure is the actor process's CPU per
episode. Three variants, alternated over ``--rounds`` rounds (medians kept):

* ``before``: calls padded to at least 8 rows, a power of two of the waiting requests taken, no cap
  on a call's size (up to the concurrency), no prefix sharing;
* ``no sharing``: the default batching -- padded to at least ``MIN_SAMPLER_BATCH`` rows, every
  waiting request taken when they fit that padding, at most ``MAX_CALL_ROWS`` rows and
  ``MAX_CALL_TOKENS`` rows x prefill tokens per call -- without prefix sharing;
* ``now``: the defaults: that batching, and a conversation with nothing usable cached (its first
  turn, or its first after a weight swap) starts from the keys/values of another that opened with
  the same prompt under the same weights (``Sampler(share_prefixes=True)``).

``--sizes`` first times single calls of every (rows, prefill bucket) shape with no episodes running:
what a call costs against its size.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from conversation_cache import alternate_rounds, compile_policies, swap_weights
from stoker.actor.environments import StepLatency
from stoker.actor.episode import run_group
from stoker.actor.policy import BatchedSampler
from stoker.actor.sandbox import inline_factory
from stoker.actor.settings import ActorSettings
from stoker.conversation.tokenization import TextInterface, text_interface
from stoker.actor.wiring import make_policy
from stoker.model.model import init_model
from stoker.rollout.sampling import chunk_buckets
from stoker.weights.channel import flatten_params
from stoker.manifest import load_job

REPO = Path(__file__).resolve().parent.parent


def before_policy(settings: ActorSettings) -> BatchedSampler:
    """The actor's sampling before: 8-row padding, calls as large as the queue, no sharing."""
    policy = no_sharing_policy(settings)
    policy.sampler.min_batch = 8
    return BatchedSampler(policy.sampler, max_batch=max(settings.concurrency, 1), max_call_tokens=1 << 30)


def no_sharing_policy(settings: ActorSettings) -> BatchedSampler:
    policy = make_policy(settings)
    policy.sampler.share_prefixes = False
    return policy


def call_sizes(sampler: Any, max_new_tokens: int) -> None:
    """CPU per call and per row of one session call, by rows and chunk bucket (idle machine)."""
    print("| chunk bucket | rows | ms per call | ms per row |")
    print("|---|---|---|---|")
    for width in chunk_buckets(sampler.session_len):
        length = min(width, sampler.session_len - max_new_tokens)
        for rows in (4, 8, 16, 32, 64):
            keys = [("size", i) for i in range(rows)]
            prompts = [[1] * length] * rows
            sampler.generate(prompts, max_new_tokens=max_new_tokens, sessions=keys)  # compiles
            repeats = max(5, 2048 // (width * rows) * 5)
            started = time.process_time()
            for _ in range(repeats):
                for key in keys:  # each call prefills the whole chunk again
                    sampler.end_session(key)
                sampler.generate(prompts, max_new_tokens=max_new_tokens, sessions=keys)
            ms = (time.process_time() - started) / repeats * 1e3
            for key in keys:
                sampler.end_session(key)
            print(f"| {width} | {rows} | {ms:.2f} | {ms / rows:.3f} |", flush=True)


async def measure(
    settings: ActorSettings, policy: BatchedSampler, interface: TextInterface, groups: int, seed: int,
    swap: list[dict[str, np.ndarray]], every: float,
) -> dict[str, float]:
    factory = inline_factory(settings.sandbox)
    slots = asyncio.Semaphore(settings.concurrency)
    swapper = asyncio.create_task(swap_weights(policy, swap, every))
    calls, requests = policy.stats.calls, policy.stats.requests
    stats = policy.sampler.cache_stats
    prompt, reused = stats.prompt_tokens, stats.reused_tokens
    started, cpu = time.perf_counter(), time.process_time()
    runs = [
        run_group(policy, factory, interface, settings.tasks[g % len(settings.tasks)], settings.group_size,
                  limits=settings.limits, seed=seed + g, slots=slots)
        for g in range(groups)
    ]
    episodes = [e for group in await asyncio.gather(*runs) for e in group]
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    swapper.cancel()
    failed = [e.status_reason for e in episodes if not e.ok]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed, e.g. {failed[0]}")
    return {
        "cpu_ms": cpu / len(episodes) * 1e3,
        "episodes_per_s": len(episodes) / elapsed,
        "rows_per_call": (policy.stats.requests - requests) / max(1, policy.stats.calls - calls),
        "reuse": (stats.reused_tokens - reused) / max(1, stats.prompt_tokens - prompt),
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--concurrency", type=int, default=256, help="episodes in flight")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per environment step")
    parser.add_argument("--swap-seconds", type=float, default=2.5, help="period of weight swaps")
    parser.add_argument("--groups", type=int, default=64, help="groups per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", action="store_true", help="first time single calls by rows and bucket")
    args = parser.parse_args()
    spec = load_job(args.manifest).spec
    base = ActorSettings.from_spec(spec, actor_id="bench", job="bench")
    cache_dir = base.compilation_cache_dir or str(Path.home() / ".cache" / "stoker" / "jax")
    sandbox = dataclasses.replace(base.sandbox, step_latency=StepLatency("fixed", args.latency))
    settings = dataclasses.replace(base, concurrency=args.concurrency, compilation_cache_dir=cache_dir, sandbox=sandbox)
    interface = text_interface(spec)
    weights = [flatten_params(init_model(settings.model, seed)) for seed in (0, 1)]
    policies = {
        "before": before_policy(settings), "no sharing": no_sharing_policy(settings), "now": make_policy(settings),
    }
    compile_policies(policies, args.concurrency, settings.limits.max_new_tokens)
    if args.sizes:
        call_sizes(policies["now"].sampler, settings.limits.max_new_tokens)

    async def measure_one(name: str, round_: int) -> dict[str, float]:
        return await measure(settings, policies[name], interface, args.groups, 1000 * round_, weights, args.swap_seconds)

    median = await alternate_rounds(
        policies, args.rounds, measure_one,
        lambda r: f"{r['cpu_ms']:.2f} ms CPU/episode, {r['episodes_per_s']:.1f} episodes/s, {r['rows_per_call']:.1f} rows per call",
    )
    print(f"\n{args.concurrency} concurrent episodes, {args.latency:g} s per step, weights swapped every "
          f"{args.swap_seconds:g} s; {args.groups} groups of {settings.group_size} per measurement, medians of "
          f"{args.rounds} rounds\n")
    print("| variant | actor CPU ms/episode | vs before | episodes/s | rows per call | prompt tokens from the cache |")
    print("|---|---|---|---|---|---|")
    for name in policies:
        cpu = median(name, "cpu_ms")
        print(f"| {name} | {cpu:.2f} | {median('before', 'cpu_ms') / cpu:.2f}x | {median(name, 'episodes_per_s'):.1f} | "
              f"{median(name, 'rows_per_call'):.1f} | {median(name, 'reuse'):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
