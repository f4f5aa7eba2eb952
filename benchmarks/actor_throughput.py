"""Actor throughput: what batching, concurrency and sandbox kind are worth (ratios in one run).

    .venv/bin/python benchmarks/actor_throughput.py [--groups 24] [--latency 0.05]

1. Sampler batching. The real JAX sampler with the default (~78k-parameter) FrozenLake policy:
   16 concurrent episodes whose turns are batched into one ``generate`` call (``BatchedSampler``,
   max_batch 16) against the same 16 episodes with one call per turn (max_batch 1).
2. Latency hiding. A scripted policy and an environment step latency of ``--latency`` seconds:
   16 concurrent episodes against 1 at a time (the synchronous baseline).
3. Sandbox cost. The same FrozenLake groups with a sandbox process per episode forked by the
   zygote (what ``kind: process`` does), against a fresh interpreter per episode (the naive way,
   and what a pod runs), and against in-process (inline) environments.
4. Inline calls. Inline FrozenLake with a scripted policy, 256 concurrent episodes and the step
   latency of part 2: calls made directly on the event loop (what FrozenLake gets) against each
   call handed to a thread (what environments that may block get). Reports the actor process's
   CPU per episode as well: at this concurrency the rate is set by the latency, the CPU is the cost.

    --parts batching latency sandbox inline-calls   (default: all)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

from stoker.actor.environments import StepLatency, options_json
from stoker.actor.frozenlake import FrozenLake
from stoker.actor.episode import EpisodeLimits, run_group
from stoker.actor.frozenlake import expert_move
from stoker.conversation.policy import Policy
from stoker.actor.policy import BatchedSampler, ScriptedPolicy
from stoker.actor.sandbox import (
    EnvironmentFactory,
    EpisodeEnvironment,
    SandboxConfig,
    SandboxEnvironment,
    InlineEnvironment,
    inline_factory,
)
from stoker.actor.process_sandbox import process_factory
from stoker.conversation.tokenization import text_interface
from stoker.spec import RLJobSpec

SPEC = RLJobSpec()
INTERFACE = text_interface(SPEC)
CONFIG = SandboxConfig("frozenlake", options_json(SPEC.environment.frozenlake))
LIMITS = EpisodeLimits(max_turns=8, max_new_tokens=SPEC.actors.sampling.max_new_tokens, max_tokens=256)


class Rate(NamedTuple):
    episodes_per_second: float
    cpu_ms_per_episode: float  # this process's CPU, every thread


async def measure(
    policy: Policy, factory: EnvironmentFactory, groups: int, group_size: int, concurrency: int
) -> Rate:
    slots = asyncio.Semaphore(concurrency)
    started, cpu = time.perf_counter(), time.process_time()
    runs = [
        run_group(policy, factory, INTERFACE, str(g % 4), group_size, limits=LIMITS, seed=g, slots=slots)
        for g in range(groups)
    ]
    episodes = [e for group in await asyncio.gather(*runs) for e in group]
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    failed = [e.status_reason for e in episodes if not e.ok]
    if failed:  # a rate of failures would measure nothing
        raise SystemExit(f"{len(failed)} episodes failed, e.g. {failed[0]}")
    return Rate(len(episodes) / elapsed, cpu / len(episodes) * 1e3)


async def episodes_per_second(
    policy: Policy, factory: EnvironmentFactory, groups: int, group_size: int, concurrency: int
) -> float:
    return (await measure(policy, factory, groups, group_size, concurrency)).episodes_per_second


class FreshInterpreterSandbox:
    """Baseline: ``python -m stoker.actor.sandbox_server`` started from scratch per episode."""

    def __init__(self, process: asyncio.subprocess.Process, port: int):
        self.process = process
        self.address = f"127.0.0.1:{port}"

    @classmethod
    async def start(cls) -> FreshInterpreterSandbox:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "stoker.actor.sandbox_server", "--port=0", "--memory-mb=512",
            cwd=tempfile.gettempdir(), stdout=asyncio.subprocess.PIPE, start_new_session=True,
            env={"PATH": os.environ["PATH"], "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1"},
        )
        assert process.stdout is not None
        line = (await process.stdout.readline()).decode()
        return cls(process, int(line.strip().split("=", 1)[1]))

    async def exit_reason(self, wait: float = 0.0) -> str | None:
        return None if self.process.returncode is None else f"exited {self.process.returncode}"

    async def mark_alive(self) -> None:
        return None

    async def kill(self) -> None:
        if self.process.returncode is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()


async def fresh_interpreter() -> EpisodeEnvironment:
    return SandboxEnvironment(await FreshInterpreterSandbox.start(), CONFIG)


def expert(prompt: list[int]) -> list[int]:
    vocab = INTERFACE.tokenizer.get_vocab()
    return [vocab[expert_move(INTERFACE.decode(prompt).split(), 4)]]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=24, help="groups of 8 per measurement")
    parser.add_argument("--latency", type=float, default=0.05, help="injected step latency (s) for parts 2 and 4")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args()
    rows: list[tuple[str, str, float, str, float]] = []
    for part in args.parts:
        rows += await PARTS[part](args)
    print("| setting | variant | value | baseline | value | ratio |")
    print("|---|---|---|---|---|---|")
    for setting, variant, v, base, bv in rows:
        print(f"| {setting} | {variant} | {v:.1f} | {base} | {bv:.1f} | {v / bv:.2f} |")


async def batching(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    from stoker.rollout.sampling import Sampler

    sampler = Sampler(SPEC.model.architecture, SPEC.actors.sampling, seed=0, buckets=(128, 256))
    batched, single = BatchedSampler(sampler, max_batch=16), BatchedSampler(sampler, max_batch=1)
    inline = inline_factory(CONFIG)
    # Compile every (batch, prefill, cache) shape either variant can meet, outside the timing: the
    # sampler compiles once per shape (seconds each here), then never again.
    warm_started = time.perf_counter()
    new = LIMITS.max_new_tokens
    for rows_n in (1, 2, 4, 8, 16):
        for length in (100, 128 - new + 1, 200):
            sampler.generate([[2] * length] * rows_n, max_new_tokens=new, stop_token_ids=INTERFACE.stop_token_ids)
    print(f"compiled {sampler.compile_count} sampler programs in {time.perf_counter() - warm_started:.0f} s")
    # Alternate the two, three rounds each, and keep the medians: the box is shared and noisy.
    b_runs, s_runs = [], []
    for _ in range(3):
        b_runs.append(await episodes_per_second(batched, inline, args.groups, 8, 16))
        s_runs.append(await episodes_per_second(single, inline, args.groups, 8, 16))
    b, s = statistics.median(b_runs), statistics.median(s_runs)
    print(f"mean batch {batched.stats.mean_batch:.1f} requests per sampler call; {sampler.compile_count} programs")
    await batched.close()
    await single.close()
    return [("JAX sampler, 16 concurrent: episodes/s", "batched (max_batch 16)", b, "one call per turn", s)]


async def latency(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    slow = inline_factory(dataclasses.replace(CONFIG, step_latency=StepLatency("fixed", args.latency)))
    c = await episodes_per_second(ScriptedPolicy(expert), slow, 2, 8, 16)
    one = await episodes_per_second(ScriptedPolicy(expert), slow, 2, 8, 1)
    return [(f"step latency {args.latency:g} s: episodes/s", "16 concurrent episodes", c, "1 at a time", one)]


async def sandbox(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    inline = inline_factory(CONFIG)
    processes = process_factory(CONFIG)
    await episodes_per_second(ScriptedPolicy(expert), processes, 1, 8, 8)  # starts the zygote
    proc = await episodes_per_second(ScriptedPolicy(expert), processes, args.groups, 8, 8)
    await processes.aclose()
    fresh = await episodes_per_second(ScriptedPolicy(expert), fresh_interpreter, 4, 8, 8)
    inl = await episodes_per_second(ScriptedPolicy(expert), inline, args.groups, 8, 8)
    setting = "sandbox per episode, 8 concurrent: episodes/s"
    return [(setting, "forked by the zygote", proc, "fresh interpreter", fresh),
            (setting, "forked by the zygote", proc, "inline (no sandbox)", inl)]  # fmt: skip


async def inline_calls(args: argparse.Namespace) -> list[tuple[str, str, float, str, float]]:
    latency = StepLatency("fixed", args.latency)

    def factory(blocking: bool) -> EnvironmentFactory:
        async def make() -> EpisodeEnvironment:
            return InlineEnvironment(FrozenLake.from_options({}), latency, blocking=blocking)

        return make

    # Alternate, three rounds each, medians kept (the box is shared and noisy).
    direct, threaded = [], []
    for _ in range(3):
        direct.append(await measure(ScriptedPolicy(expert), factory(False), 4 * args.groups, 8, 256))
        threaded.append(await measure(ScriptedPolicy(expert), factory(True), 4 * args.groups, 8, 256))
    d_cpu, t_cpu = (statistics.median(r.cpu_ms_per_episode for r in runs) for runs in (direct, threaded))
    d_rate, t_rate = (statistics.median(r.episodes_per_second for r in runs) for runs in (direct, threaded))
    setting = f"inline FrozenLake, 256 concurrent, step latency {args.latency:g} s"
    return [(f"{setting}: actor CPU ms/episode", "calls in a thread", t_cpu, "calls made directly", d_cpu),
            (f"{setting}: episodes/s", "calls made directly", d_rate, "calls in a thread", t_rate)]  # fmt: skip


PARTS = {"batching": batching, "latency": latency, "sandbox": sandbox, "inline-calls": inline_calls}


if __name__ == "__main__":
    asyncio.run(main())
