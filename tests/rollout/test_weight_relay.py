"""Rollout servers relaying sharded weights to each other (stoker.weights.shard_relay), as real
processes over loopback: a pipelined chain takes one copy of a version out of the learner, every
server bit-exact, each hop over the relays' shard stream (or gRPC); a relay killed mid-transfer
makes its reader take the rest from the learner; a relay lying over either transport is caught."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher
from stoker.weights import shard_service
from stoker.model.hf import to_hf
from stoker.model.model import init_model
from stoker.weights.relay_source import RelayedSource
from stoker.weights.shard_relay import WeightRelay
from stoker.weights.shards import ShardsCorrupt, geometry
from stoker.weights.channel import WeightSubscriber
from stoker.spec import TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
TOTAL = sum(a.nbytes for a in to_hf(init_model(CONFIG, 7, jnp.bfloat16)).values())
WORKER = Path(__file__).with_name("relay_worker.py")


def wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}: {proc.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {seconds} s"
        time.sleep(0.02)


def start(out: Path, name: str, learner: str, version: int, *upstream: str, stream: bool = True) -> tuple[subprocess.Popen[str], str]:
    """A relay worker reading from ``upstream`` (``ADDR`` or ``ADDR=STREAM_ADDR``); its gRPC
    address, plus ``=STREAM_ADDR`` when it serves the shard stream (what the next one reads)."""
    flags = [a for u in upstream for a in ("--relay-from", u)]
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), name, learner, str(version), *flags, *([] if stream else ["--no-stream"])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    wait_for(out / f"{name}.port", proc)
    address = f"127.0.0.1:{(out / f'{name}.port').read_text()}"
    if stream:
        wait_for(out / f"{name}.stream", proc)
        address += f"=127.0.0.1:{(out / f'{name}.stream').read_text()}"
    return proc, address


@contextlib.contextmanager
def publish(stream: bool = False) -> Iterator[tuple[ShardedPublisher, dict[str, str], int]]:
    """One learner process's server holding version 1 (many 256-byte checksum blocks); its bytes
    over gRPC ReadShard only (what the gates below hook) unless ``stream``."""
    model = init_model(CONFIG, 7, jnp.bfloat16)
    want = {name: hashlib.sha256(a.tobytes()).hexdigest() for name, a in to_hf(model).items()}
    with ShardedPublisher(address="127.0.0.1:0", processes=Processes(), block_bytes=256, stream=stream) as publisher:
        manifest = publisher.publish(1, model)
        assert manifest is not None
        yield publisher, want, manifest.nbytes


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["grpc", "stream"])
def test_a_chain_of_relaying_servers_takes_one_copy_from_the_learner_and_each_is_bit_exact(tmp_path: Path, stream: bool) -> None:
    with publish(stream) as published:  # every hop over gRPC, or over the plain-TCP shard streams
        chain(tmp_path, *published, stream=stream)


def chain(tmp_path: Path, publisher: ShardedPublisher, want: dict[str, str], total: int, stream: bool) -> None:
    learner = f"127.0.0.1:{publisher.port}"
    procs: list[subprocess.Popen[str]] = []
    try:
        first, address = start(tmp_path, "r0", learner, 1, stream=stream)
        procs.append(first)
        for i in (1, 2):  # r0 <- learner, r1 <- r0, r2 <- r1, all reading at once
            proc, address = start(tmp_path, f"r{i}", learner, 1, address, stream=stream)
            procs.append(proc)
        (tmp_path / "go").touch()
        for i, proc in enumerate(procs):
            wait_for(tmp_path / f"r{i}.json", proc)
        results = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(3)]
    finally:
        (tmp_path / "done").touch()
        logs = [proc.communicate(timeout=60)[0] for proc in procs]
    for result, log in zip(results, logs, strict=True):
        assert result["fallbacks"] == 0, log[-3000:]
    for result in results:
        assert result["sha256"] == want
        assert result["fallbacks"] == 0
    # The learner sent the version out once; every server below the first took all of it from a relay.
    streamed = publisher.stream.served_bytes if publisher.stream else 0
    assert (publisher.server.servicer.served_bytes, streamed) == ((0, total) if publisher.stream else (total, 0))
    assert results[0]["taken"] == {"primary": total}
    hop = " stream" if stream else ""
    assert [list(r["taken"].items()) for r in results[1:]] == [[(f"relay {a}{hop}", total)] for a in (
        f"127.0.0.1:{(tmp_path / 'r0.port').read_text()}", f"127.0.0.1:{(tmp_path / 'r1.port').read_text()}"
    )]
    # Each relay's egress: one copy over the transport the hop below used, nothing over the other.
    served = [json.loads((tmp_path / f"r{i}.served.json").read_text()) for i in range(3)]
    one = {"grpc": 0, "stream": total} if stream else {"grpc": total, "stream": 0}
    assert served == [one, one, {"grpc": 0, "stream": 0}]


def gate_learner_after_half(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The learner's gRPC ReadShard stops after half the version (``halfway`` set) until ``gate``
    is set. Call before the publisher's server binds ReadShard."""
    gate, halfway = threading.Event(), threading.Event()
    real = shard_service._ShardServicer.ReadShard

    def gated(self: Any, request: Any, context: Any) -> Iterator[Any]:
        for chunk in real(self, request, context):
            if self.served_bytes >= TOTAL // 2 and not gate.is_set():
                halfway.set()
                assert gate.wait(120), "the test never opened the gate"
            yield chunk

    monkeypatch.setattr(shard_service._ShardServicer, "ReadShard", gated)
    return gate, halfway


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["grpc", "stream"])
def test_a_relay_killed_mid_transfer_leaves_its_reader_to_finish_from_the_learner_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # The learner stops sending after half the version until the relay is dead: the relay holds
    # half, its reader has some of that half, and the rest must come from the learner.
    gate, halfway = gate_learner_after_half(monkeypatch)
    with publish() as (publisher, want, total):
        killed_mid_transfer(tmp_path, publisher, want, total, gate, halfway, stream)


def read_version_into(learner: str, reader: WeightRelay, result: dict[str, Any]) -> None:
    """Read version 1 whole through ``reader``'s relays into ``result["sha256"]`` (per tensor), or
    ``result["error"]``: a thread's body, asserted on by the test that starts it."""
    try:
        with WeightSubscriber(address=learner, relay=reader) as subscriber:
            weights: Any = subscriber.fetch(1)
            names = list(weights.manifest.tensors)
            parts = weights.read_boxes([(n, tuple((0, d) for d in weights.manifest.tensors[n].shape)) for n in names])
            result["sha256"] = {n: hashlib.sha256(p.tobytes()).hexdigest() for n, p in zip(names, parts, strict=True)}
    except Exception as exc:  # noqa: BLE001 - reported by the assertion below
        result["error"] = repr(exc)


def killed_mid_transfer(
    tmp_path: Path, publisher: ShardedPublisher, want: dict[str, str], total: int, gate: threading.Event,
    halfway: threading.Event, stream: bool,
) -> None:
    learner = f"127.0.0.1:{publisher.port}"
    relay_proc, advertised = start(tmp_path, "r0", learner, 1, stream=stream)
    relay_address, _, relay_stream = advertised.partition("=")
    reader = WeightRelay((relay_address,), wait_s=60.0, upstream_streams={relay_address: relay_stream} if stream else None)
    taken_from_relay = f"relay {relay_address}" + (" stream" if stream else "")
    result: dict[str, Any] = {}
    thread = threading.Thread(target=read_version_into, args=(learner, reader, result))
    try:
        (tmp_path / "go").touch()
        thread.start()
        assert halfway.wait(120), "the relay never read half the version"
        deadline = time.monotonic() + 120
        while reader.stats.taken.get(taken_from_relay, 0) == 0:
            assert time.monotonic() < deadline and thread.is_alive(), (result, reader.stats)
            time.sleep(0.01)  # until the reader has part of the version from the relay
        relay_proc.send_signal(signal.SIGKILL)
        relay_proc.wait(timeout=30)
        gate.set()
        thread.join(timeout=120)
    finally:
        gate.set()
        (tmp_path / "done").touch()
        if relay_proc.poll() is None:
            relay_proc.kill()
        reader.close()
    assert not thread.is_alive() and "error" not in result, result
    assert result["sha256"] == want
    from_relay, from_learner = reader.stats.taken.get(taken_from_relay, 0), reader.stats.taken.get("primary", 0)
    assert from_relay > 0 and from_learner > 0 and from_relay + from_learner == total, reader.stats
    assert set(reader.stats.taken) == {taken_from_relay, "primary"}, reader.stats  # the dead relay's gRPC gave nothing
    assert reader.stats.fallbacks >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["grpc", "stream"])
def test_a_relay_sending_a_bad_block_is_caught_by_its_crc32_and_the_reader_reads_it_from_the_learner(stream: bool) -> None:
    with publish() as (publisher, want, total):
        bad = WeightRelay(stream_port=0 if stream else None)
        bad.serve("127.0.0.1:0")
        bad_address = f"127.0.0.1:{bad.port}"
        streams = {bad_address: f"127.0.0.1:{bad.stream_server.port}"} if stream else None
        reader = WeightRelay((bad_address,), upstream_streams=streams)
        try:
            with WeightSubscriber(address=f"127.0.0.1:{publisher.port}") as plain:
                weights: Any = plain.fetch(1)
                name = "model.embed_tokens.weight"
                shard = weights.manifest.tensors[name].shards[0]
                step = geometry(weights.manifest, shard).block_bytes
                data = weights.source.read(weights.manifest, shard, 0, geometry(weights.manifest, shard).total_bytes)
                blocks = [data[at : at + step] for at in range(0, len(data), step)]
                assert len(blocks) > 2
                # The relay holds every block of this shard, the second one with a flipped byte.
                blocks[1] = bytes([blocks[1][0] ^ 1]) + blocks[1][1:]
                bad.cache.expect(weights.manifest, [(shard.key, b) for b in range(len(blocks))])
                for b, block in enumerate(blocks):
                    bad.cache.put(weights.manifest, shard.key, b, block)
            with WeightSubscriber(address=f"127.0.0.1:{publisher.port}", relay=reader) as subscriber:
                got = subscriber.fetch(1)[name]
            assert hashlib.sha256(got.tobytes()).hexdigest() == want[name]
            # Block 0 came from the relay (over its stream, if it has one); the bad block 1 was
            # refused from each of the relay's transports, and it and the rest came from the learner.
            assert reader.stats.fallbacks == (2 if stream else 1), reader.stats
            first = f"relay {bad_address}" + (" stream" if stream else "")
            assert reader.stats.taken == {first: step, "primary": got.nbytes - step}, reader.stats
            if stream:
                assert bad.stream_server.served_bytes >= 2 * step  # block 1 did go out over the stream
        finally:
            reader.close()
            bad.close()


def test_a_relay_checks_each_block_from_a_primary_that_does_not_and_keeps_views_of_its_read_not_copies() -> None:
    # The relay's reads say they verify every block (the reader does not check again), so a
    # primary that does not check (a directory, a gRPC peer) must have each block checked here.
    with publish() as (publisher, want, total):
        relay = WeightRelay(stream_port=None)
        try:
            with WeightSubscriber(address=f"127.0.0.1:{publisher.port}") as plain:
                weights: Any = plain.fetch(1)
                manifest, learner = weights.manifest, weights.source
                shard = manifest.tensors["model.embed_tokens.weight"].shards[0]
                shape = geometry(manifest, shard)
                blocks = -(-shape.total_bytes // shape.block_bytes)
                assert blocks > 2 and not getattr(learner, "verifies_blocks", False)

                class Flipping:  # returns the learner's bytes with the last one flipped, unchecked
                    def read(self, m: Any, s: Any, offset: int, size: int) -> bytearray:
                        data = bytearray(learner.read(m, s, offset, size))
                        data[-1] ^= 1
                        return data

                lying = RelayedSource(relay, Flipping())
                assert lying.verifies_blocks
                lying.expect(manifest, [(shard.key, b) for b in range(blocks)])
                with pytest.raises(ShardsCorrupt, match=f"block {blocks - 1} from primary"):
                    lying.read(manifest, shard, 0, shape.total_bytes)
                now = time.monotonic()
                assert relay.cache.block(1, shard.key, blocks - 2, now) is not None  # the good ones are kept
                assert relay.cache.block(1, shard.key, blocks - 1, now) is None  # the bad one is not

                out = RelayedSource(relay, learner).read(manifest, shard, 0, shape.total_bytes)
                assert bytes(out) == bytes(learner.read(manifest, shard, 0, shape.total_bytes))
                held = relay.cache.block(1, shard.key, 1, time.monotonic())
                assert held is not None and bytes(held) == bytes(out[shape.block_bytes : 2 * shape.block_bytes])
                assert np.shares_memory(np.frombuffer(held, np.uint8), np.frombuffer(out, np.uint8))
        finally:
            relay.close()
