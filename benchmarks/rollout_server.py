"""The rollout server: what batching segments cost, tokens/s against offered load, and what long
prefills cost the decoding turns.

    .venv/bin/python benchmarks/rollout_server.py [--hidden 256] [--layers 4] [--new-tokens 32]
                                                  [--loads 1,2,4,8,16,32,64] [--seconds 8]
    .venv/bin/python benchmarks/rollout_server.py --long-prefills [--long-tokens 1024] [--decoders 7]

Part 1, segment overhead (engine driven inline, no gRPC): B conversations each generate
``--new-tokens`` tokens (no stop token), either as one ``Sampler.generate`` call (the baseline) or
through the ``Engine`` in segments of K decode steps. Reports ms per generated token and the
ratio to the baseline, per K.

Part 2, offered load: a real ``RolloutServer`` on loopback; C concurrent clients (``RemotePolicy``,
as actors use it) each play multi-turn conversations (a turn: ``--new-tokens`` tokens, then a
4-token environment reply; a new conversation every 4 turns), for ``--seconds`` per load. Reports
the server's sampled tokens/s, mean turn latency and batch occupancy per C. Clients share the
process (and CPU) with the server, as on a 2-core machine they would anyway.

Part 3, long prefills (``--long-prefills``, a server on loopback as in part 2): ``--decoders``
clients play conversations of ``--new-tokens`` turns, alone, then beside one client whose every
turn opens a new session with ``--long-tokens`` uncached tokens (a tool's long output), with the
engine prefilling such turns in the decode segment's call (before) or apart from it (after).
Interleaved rounds; reports the decoders' tokens/s and the long turns' latency per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from stoker.rollout.client import RemotePolicy
from stoker.rollout.engine import PREFILL_APART_ABOVE, Engine
from stoker.rollout.sampling import Sampler
from stoker.rollout.server import RolloutServer
from stoker.rollout.turns import TurnResult
from stoker.spec import SamplingSpec, TransformerConfig


def make_sampler(args: argparse.Namespace, rows: int, min_batch: int = 1, max_seq_len: int = 512) -> Sampler:
    config = TransformerConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.hidden // 64,
        num_kv_heads=max(1, args.hidden // 128), intermediate_size=4 * args.hidden, max_seq_len=max_seq_len,
    )
    return Sampler(config, SamplingSpec(temperature=1.0), seed=0, buckets=(max_seq_len,), session_rows=rows,
                   pin_sessions=True, min_chunk=args.min_chunk, min_batch=min_batch)


def prompt(i: int, n: int = 24) -> list[int]:
    return [(7 * i + j) % 97 + 1 for j in range(n)]


def segment_overhead(args: argparse.Namespace) -> None:
    batch, n = args.batch, args.new_tokens
    sampler = make_sampler(args, 4 * batch, min_batch=batch)
    engine = Engine(sampler, max_batch=batch, max_queue=batch, segment_tokens=n)
    round_ = iter(range(1_000_000))

    def whole() -> float:
        r = next(round_)
        sessions = [f"w{r}/{i}" for i in range(batch)]
        t0 = time.perf_counter()
        gens = sampler.generate([prompt(i) for i in range(batch)], max_new_tokens=n, sessions=sessions)
        elapsed = time.perf_counter() - t0
        assert all(len(g.token_ids) == n for g in gens)
        for s in sessions:
            sampler.end_session(s)
        return elapsed

    def segmented(k: int) -> float:
        r = next(round_)
        engine.segment_tokens = k
        done: list[TurnResult | BaseException] = []
        t0 = time.perf_counter()
        for i in range(batch):
            engine.submit(prompt(i), max_new_tokens=n, stop_token_ids=(), session=f"s{r}/{i}", pin_weights=False,
                          on_done=done.append)
        while len(done) < batch:
            engine.step()
        elapsed = time.perf_counter() - t0
        assert all(isinstance(d, TurnResult) and len(d.token_ids) == n for d in done)
        for i in range(batch):
            engine.end_session(f"s{r}/{i}")
        engine.step()
        return elapsed

    ks = [k for k in (1, 2, 4, 8, 16, 32) if k < n] + [n]
    for k in ks:  # compile every program first
        segmented(k)
    whole()
    times: dict[str, list[float]] = {name: [] for name in ["whole call", *(f"K={k}" for k in ks)]}
    for _ in range(args.rounds):  # interleaved: the machine is shared
        times["whole call"].append(whole())
        for k in ks:
            times[f"K={k}"].append(segmented(k))
    base = statistics.median(times["whole call"])
    print(f"\nsegment overhead: batch {batch}, {n} new tokens per turn, medians of {args.rounds} rounds")
    print("| variant | ms per token | vs one call |\n|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {1000 * med / (batch * n):.3f} | {med / base:.2f}x |")


async def offered_load(args: argparse.Namespace) -> None:
    loads = [int(x) for x in args.loads.split(",")]
    top = max(loads)
    sampler = make_sampler(args, 2 * top, min_batch=args.max_batch)  # padded to the batch, as the server is
    engine = Engine(sampler, max_batch=args.max_batch, max_queue=4 * top, segment_tokens=args.segment_tokens)
    server = RolloutServer(engine).start()
    address = f"127.0.0.1:{server.port}"
    print(f"\noffered load: max batch {args.max_batch}, segments of {args.segment_tokens}, {args.new_tokens} tokens per turn")
    print("| concurrent clients | tokens/s | vs 1 client | mean turn latency (s) | batch occupancy |\n|---|---|---|---|---|")
    base = None
    try:
        for load in loads:
            await run_load(address, load, 2.0, args)  # warm-up: compiles this batch size's programs
            tokens, latencies, occupancy, wall = await run_load(address, load, args.seconds, args)
            rate = tokens / wall
            base = base or rate
            print(f"| {load} | {rate:.0f} | {rate / base:.2f}x | {statistics.mean(latencies):.3f} | {occupancy:.2f} |")
            sys.stdout.flush()
    finally:
        server.stop(grace=0)


async def run_load(address: str, clients: int, seconds: float, args: argparse.Namespace) -> tuple[int, list[float], float, float]:
    policies = [RemotePolicy(address, actor_id=f"bench-{i}", seed=i) for i in range(clients)]
    stop_at = time.perf_counter() + seconds
    turns: list[tuple[float, int]] = []
    occupancy: list[float] = []

    async def sample_stats() -> None:
        while time.perf_counter() < stop_at:
            await asyncio.sleep(0.5)
            stats = await policies[0].server_stats()
            occupancy.append(stats.running / stats.max_batch)

    t0 = time.perf_counter()
    await asyncio.gather(
        *(converse(p, i, args.new_tokens, stop_at, turns) for i, p in enumerate(policies)), sample_stats()
    )
    wall = time.perf_counter() - t0
    for p in policies:
        await p.close()
    tokens = sum(n for _, n in turns)
    return tokens, [latency for latency, _ in turns], statistics.mean(occupancy) if occupancy else 0.0, wall


async def converse(
    policy: RemotePolicy, index: int, new_tokens: int, stop_at: float, turns: list[tuple[float, int]]
) -> None:
    """One client until ``stop_at``: 4-turn conversations of ``new_tokens``-token turns, each
    followed by a 4-token environment reply; appends (latency, tokens sampled) per turn."""
    episode = 0
    while time.perf_counter() < stop_at:
        ids, session = prompt(index + 31 * episode), f"{episode}"
        for turn in range(4):
            t0 = time.perf_counter()
            sampled = await policy.generate(ids, max_new_tokens=new_tokens, stop_token_ids=(), session=session)
            turns.append((time.perf_counter() - t0, len(sampled.token_ids)))
            ids = ids + sampled.token_ids + [5, 6, 7, 8 + turn]
        await policy.end_session(session)
        episode += 1


async def long_prefills(args: argparse.Namespace) -> None:
    """Part 3: decoding clients' tokens/s alone, and beside one client whose every turn is a long
    new prompt, with that prompt prefilled in the decode segment's call or apart from it."""
    seq_len = max(2 * args.long_tokens, 512)
    sampler = make_sampler(args, 2 * args.max_batch, min_batch=args.max_batch, max_seq_len=seq_len)
    engine = Engine(sampler, max_batch=args.max_batch, max_queue=4 * args.max_batch, segment_tokens=args.segment_tokens)
    server = RolloutServer(engine).start()
    address = f"127.0.0.1:{server.port}"
    variants: dict[str, tuple[bool, int | None]] = {
        "decoders alone": (False, None),
        "+ long turns, prefilled in the shared call (before)": (True, None),
        "+ long turns, prefilled apart (after)": (True, args.prefill_apart_above),
    }
    decode_rates: dict[str, list[float]] = {name: [] for name in variants}
    long_latency: dict[str, list[float]] = {name: [] for name in variants}
    long_rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(args.rounds + 1):  # round 0 compiles every program and is not counted
            for name, (with_long, apart_above) in variants.items():
                engine.prefill_apart_above = apart_above  # between runs: no turn in flight
                seconds = 3.0 if round_ == 0 else args.seconds
                rate, latencies, wall = await run_mixed(address, args, seconds, with_long, tag=f"{round_}/{name[:8]}")
                if round_:
                    decode_rates[name].append(rate)
                    long_latency[name] += latencies
                    long_rates[name].append(len(latencies) / wall)
    finally:
        server.stop(grace=0)
    base = statistics.median(decode_rates["decoders alone"])
    print(f"\nlong prefills: {args.decoders} decoding clients ({args.new_tokens}-token turns) and one client sending "
          f"{args.long_tokens}-token new turns; max batch {args.max_batch}, segments of {args.segment_tokens}, "
          f"medians of {args.rounds} interleaved rounds of {args.seconds:.0f} s")
    print("| variant | decoders' tokens/s | vs decoders alone | long turns/s | long turn latency (s) "
          "| decoders' tokens lost per long turn |\n|---|---|---|---|---|---|")
    for name in variants:
        rate = statistics.median(decode_rates[name])
        if not long_latency[name]:
            print(f"| {name} | {rate:.0f} | {rate / base:.2f}x | - | - | - |")
            continue
        long_rate = statistics.median(long_rates[name])
        latency = statistics.median(long_latency[name])
        print(f"| {name} | {rate:.0f} | {rate / base:.2f}x | {long_rate:.2f} | {latency:.2f} | {(base - rate) / long_rate:.0f} |")


async def run_mixed(
    address: str, args: argparse.Namespace, seconds: float, with_long: bool, tag: str
) -> tuple[float, list[float], float]:
    """Decoders play 4-turn conversations of ``--new-tokens`` turns; the long client, if any, sends
    back to back turns that each open a new session with ``--long-tokens`` tokens (a tool's long
    output: all of it uncached), sampling 16 tokens. Returns the decoders' tokens/s, the long
    turns' latencies and the wall time."""
    decoders = [RemotePolicy(address, actor_id=f"dec-{tag}-{i}", seed=i) for i in range(args.decoders)]
    long_client = RemotePolicy(address, actor_id=f"long-{tag}", seed=99)
    stop_at = time.perf_counter() + seconds
    decoded: list[tuple[float, int]] = []
    latencies: list[float] = []

    async def long_turns() -> None:
        turn = 0
        while time.perf_counter() < stop_at:
            ids = prompt(1000 + turn, args.long_tokens)  # distinct openings: no shared prefix to reuse
            t0 = time.perf_counter()
            await long_client.generate(ids, max_new_tokens=16, stop_token_ids=(), session=f"t{turn}")
            latencies.append(time.perf_counter() - t0)
            await long_client.end_session(f"t{turn}")
            turn += 1

    t0 = time.perf_counter()
    await asyncio.gather(
        *(converse(p, i, args.new_tokens, stop_at, decoded) for i, p in enumerate(decoders)),
        *([long_turns()] if with_long else []),
    )
    wall = time.perf_counter() - t0
    for p in [*decoders, long_client]:
        await p.close()
    return sum(n for _, n in decoded) / wall, latencies, wall


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="part 1: conversations per call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--segment-tokens", type=int, default=16)
    parser.add_argument("--loads", default="1,2,4,8,16,32,64")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--skip-segments", action="store_true")
    parser.add_argument("--long-prefills", action="store_true", help="run part 3 (only)")
    parser.add_argument("--decoders", type=int, default=7, help="part 3: decoding clients")
    parser.add_argument("--long-tokens", type=int, default=1024, help="part 3: tokens of each long new turn")
    parser.add_argument("--prefill-apart-above", type=int, default=PREFILL_APART_ABOVE,
                        help="part 3: the engine's threshold in the 'after' variant")
    parser.add_argument("--min-chunk", type=int, default=1, help="smallest session chunk (the server's: 1; the actors': 16)")
    args = parser.parse_args(argv)
    if args.long_prefills:
        asyncio.run(long_prefills(args))
        return
    if not args.skip_segments:
        segment_overhead(args)
    asyncio.run(offered_load(args))


if __name__ == "__main__":
    main()
