"""The sampler's conversation cache: actor episodes/s with and without it (ratios in one run).

    .venv/bin/python benchmarks/conversation_cache.py [--manifest examples/frozenlake.yaml]
                                                      [--concurrency 64] [--groups 32] [--swap-seconds 0.4]

One actor's episode loop exactly as ``stoker actor`` builds it from the manifest (its model,
sampling settings and sampler buckets; ``make_policy``), with inline FrozenLake environments and no
step latency, so the actor's own CPU is what is measured. Weights are swapped every
``--swap-seconds`` (a new policy version each time, as a learner publishing ~2.5 updates/s makes
the actors do). Variants, alternated over three rounds (medians kept; the machine is shared):

* ``no cache``: ``conversationCacheMiB: 0``, every turn prefills the whole conversation (baseline);
* ``between-turns``: the cache, but a swap makes every running conversation prefill again;
* ``between-episodes``: the cache with each episode kept on the weights it started with;
* ``no swaps``: the cache and no weight swaps (its ceiling).

Reports episodes/s, the ratio to the baseline, turns per episode and the share of prompt tokens
read from the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

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


async def swap_weights(policy: BatchedSampler, versions: list[dict[str, np.ndarray]], every: float) -> None:
    version = policy.version
    while True:
        await asyncio.sleep(every)
        version += 1
        await policy.load_weights(versions[version % len(versions)], version)


def compile_all(sampler: Any, concurrency: int, max_new_tokens: int) -> None:
    """Compile every program a variant can meet before timing (the first calls of a fresh actor
    compile them, once; a measurement that included them would time XLA's compiler)."""
    batches = [1 << k for k in range(max(concurrency, 1).bit_length())]
    if sampler.keeps_sessions:
        for batch in batches:
            for chunk in chunk_buckets(sampler.session_len):
                length = min(chunk, sampler.session_len - max_new_tokens)
                keys = [("warm", i) for i in range(batch)]
                sampler.generate([[1] * length] * batch, max_new_tokens=max_new_tokens, sessions=keys)
                for key in keys:
                    sampler.end_session(key)
    else:
        for batch in batches:
            for length in sorted({min(b, sampler.buckets[-1] - max_new_tokens) for b in sampler.buckets}):
                sampler.generate([[1] * length] * batch, max_new_tokens=max_new_tokens)
                sampler.generate([[1] * (length - 1)] * batch, max_new_tokens=max_new_tokens)


def compile_policies(policies: dict[str, BatchedSampler], concurrency: int, max_new_tokens: int) -> None:
    """``compile_all`` for each variant's sampler, with how long it took."""
    for name, policy in policies.items():
        warm = time.perf_counter()
        compile_all(policy.sampler, concurrency, max_new_tokens)
        print(f"{name}: {policy.sampler.compile_count} programs compiled in {time.perf_counter() - warm:.0f} s", flush=True)


async def alternate_rounds(
    policies: dict[str, BatchedSampler], rounds: int, measure_one: Callable[[str, int], Awaitable[dict[str, float]]],
    describe: Callable[[dict[str, float]], str],
) -> Callable[[str, str], float]:
    """Every variant once per round, in turn (drifting background load hits them alike); prints
    each result as ``describe`` words it, closes the policies, and returns ``median(variant, key)``
    over the rounds."""
    results: dict[str, list[dict[str, float]]] = {name: [] for name in policies}
    for round_ in range(rounds):
        for name in policies:
            r = await measure_one(name, round_)
            results[name].append(r)
            print(f"round {round_ + 1} {name}: {describe(r)}", flush=True)
    for policy in policies.values():
        await policy.close()

    def median(name: str, key: str) -> float:
        return float(np.median([r[key] for r in results[name]]))

    return median


async def measure(
    settings: ActorSettings, policy: BatchedSampler, interface: TextInterface, groups: int, swap: list[Any], every: float
) -> dict[str, float]:
    factory = inline_factory(settings.sandbox)
    slots = asyncio.Semaphore(settings.concurrency)
    swapper = asyncio.create_task(swap_weights(policy, swap, every)) if swap else None
    stats = getattr(policy.sampler, "cache_stats", None)
    before = (stats.prompt_tokens, stats.reused_tokens) if stats else (0, 0)
    started = time.perf_counter()
    runs = [
        run_group(policy, factory, interface, settings.tasks[g % len(settings.tasks)], settings.group_size,
                  limits=settings.limits, seed=g, slots=slots)
        for g in range(groups)
    ]
    episodes = [e for group in await asyncio.gather(*runs) for e in group]
    elapsed = time.perf_counter() - started
    if swapper is not None:
        swapper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await swapper
    failed = [e.status_reason for e in episodes if not e.ok]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed, e.g. {failed[0]}")
    prompt = (stats.prompt_tokens - before[0]) if stats else 0
    reused = (stats.reused_tokens - before[1]) if stats else 0
    return {
        "episodes_per_s": len(episodes) / elapsed,
        "turns": sum(e.num_turns for e in episodes) / len(episodes),
        "reuse": reused / prompt if prompt else 0.0,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    parser.add_argument("--groups", type=int, default=32, help="groups per measurement")
    parser.add_argument("--swap-seconds", type=float, default=0.4, help="period of weight swaps")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = load_job(args.manifest).spec
    base = ActorSettings.from_spec(spec, actor_id="bench", job="bench")
    # The variants compile the same programs: the persistent cache compiles each once.
    cache_dir = base.compilation_cache_dir or str(Path.home() / ".cache" / "stoker" / "jax")
    base = dataclasses.replace(base, concurrency=args.concurrency, compilation_cache_dir=cache_dir)
    interface = text_interface(spec)
    weights = [flatten_params(init_model(base.model, seed)) for seed in (0, 1)]
    variants: dict[str, tuple[ActorSettings, bool]] = {
        "no cache": (dataclasses.replace(base, conversation_cache_mib=0), True),
        "between-turns": (dataclasses.replace(base, weight_sync="between-turns"), True),
        "between-episodes": (dataclasses.replace(base, weight_sync="between-episodes"), True),
        "no swaps": (dataclasses.replace(base, weight_sync="between-turns"), False),
    }
    policies = {name: make_policy(settings) for name, (settings, _) in variants.items()}
    compile_policies(policies, args.concurrency, base.limits.max_new_tokens)

    async def measure_one(name: str, round_: int) -> dict[str, float]:
        settings, swaps = variants[name]
        return await measure(settings, policies[name], interface, args.groups, weights if swaps else [], args.swap_seconds)

    median = await alternate_rounds(
        policies, args.rounds, measure_one,
        lambda r: f"{r['episodes_per_s']:.1f} episodes/s, {r['turns']:.2f} turns, reuse {r['reuse']:.2f}",
    )
    baseline = median("no cache", "episodes_per_s")
    print(f"\n{args.concurrency} concurrent episodes, {args.groups} groups of {base.group_size} per measurement, "
          f"weights swapped every {args.swap_seconds:g} s (except 'no swaps'); medians of {args.rounds} rounds\n")
    print("| variant | episodes/s | vs no cache | turns/episode | prompt tokens from the cache |")
    print("|---|---|---|---|---|")
    for name in variants:
        rate = median(name, "episodes_per_s")
        print(f"| {name} | {rate:.1f} | {rate / baseline:.2f}x | {median(name, 'turns'):.2f} | {median(name, 'reuse'):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
