"""Relaying rollout servers that find their upstream through the learner's weights server (the
``Relays`` RPC, stoker.weights.relay_registry), as real processes over loopback: what the operator
wires on a cluster, where servers have no stable names (``--weights-relay-advertise``)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from stoker.weights.publish import ShardedPublisher
from stoker.model.hf import to_hf
from stoker.model.model import init_model
from stoker.weights.relay_registry import RelayRegistry, upstream_positions
from stoker.weights.shard_relay import WeightRelay
from stoker.weights.channel import WeightSubscriber

from .test_weight_relay import CONFIG, WORKER, gate_learner_after_half, publish, read_version_into, wait_for


def start(out: Path, name: str, learner: str, go: str = "go") -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), name, learner, "1", "--discover", "--go", go],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    wait_for(out / f"{name}.port", proc)
    return proc, f"127.0.0.1:{(out / f'{name}.port').read_text()}"


def readers(publisher: ShardedPublisher) -> tuple[str, ...]:
    """The registered readers of version 1, in order (one layout: every reader reads it whole)."""
    trees = publisher.server.servicer.relays.trees(1)
    assert len(trees) <= 1, trees
    return next(iter(trees.values()), ())


def test_the_registry_places_readers_as_a_heap_and_names_the_nearest_ancestors_first() -> None:
    assert [upstream_positions(i) for i in range(4)] == [(), (0,), (1, 0), (2, 1)]  # a chain
    assert [upstream_positions(i, fanout=2) for i in range(7)] == [(), (0,), (0,), (1, 0), (1, 0), (2, 0), (2, 0)]
    registry = RelayRegistry(fanout=2, keep=2)
    assert [registry.join(5, "tp1", f"s{i}") for i in range(4)] == [(), ("s0",), ("s0",), ("s1", "s0")]
    assert registry.join(5, "tp1", "s2") == ("s0",)  # registering again keeps the place
    assert registry.join(5, "tp2", "t0") == ()  # another layout: its own tree, read from the learner
    registry.join(6, "tp1", "s9")
    registry.join(7, "tp1", "s9")  # version 5's trees are dropped (keep 2)
    assert registry.trees(5) == {} and registry.join(5, "tp1", "s3") == ()
    with pytest.raises(ValueError):
        registry.join(7, "tp1", "")
    # Each relay's stream address goes to the readers below it ("" for one that serves none).
    registry.join(7, "tp1", "s10", stream="s10:50056")
    assert registry.join(7, "tp1", "s11") == ("s9",)  # fan-out 2: s9 is s10's and s11's parent
    assert registry.streams(7, ("s10", "s9", "s11")) == ("s10:50056", "", "")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_servers_registering_with_the_learner_take_one_copy_from_it_and_each_is_bit_exact(tmp_path: Path) -> None:
    with publish() as (publisher, want, total):
        learner = f"127.0.0.1:{publisher.port}"
        procs: list[subprocess.Popen[str]] = []
        try:
            addresses = {}
            for i in range(4):
                proc, addresses[f"r{i}"] = start(tmp_path, f"r{i}", learner)
                procs.append(proc)
            (tmp_path / "go").touch()  # all four read at once; the registry orders them
            for i, proc in enumerate(procs):
                wait_for(tmp_path / f"r{i}.json", proc)
            results = {f"r{i}": json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(4)}
        finally:
            (tmp_path / "done").touch()
            logs = [proc.communicate(timeout=60)[0] for proc in procs]
        for result in results.values():
            assert result["sha256"] == want
            assert result["fallbacks"] == 0, logs
        # However many servers read it, the learner sent the version out once.
        assert publisher.server.servicer.served_bytes == total
        order = readers(publisher)
        assert sorted(order) == sorted(addresses.values()), logs
        name_of = {a: n for n, a in addresses.items()}
        for position, address in enumerate(order):
            result = results[name_of[address]]
            # Each read the whole version from the relay the registry named (its parent in the chain).
            upstream = [order[p] for p in upstream_positions(position)]
            assert result["upstream"] == {"1": upstream}
            # Over the parent's shard stream, which it registered beside its address.
            assert result["taken"] == ({f"relay {upstream[0]} stream": total} if upstream else {"primary": total})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_relay_killed_mid_transfer_leaves_its_reader_to_finish_from_the_next_relay_up_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # learner <- r0 <- r1 <- reader. The learner stops sending after half the version until r1
    # is dead: the reader has part of that half from r1, and the rest must come from r0 (its
    # grandparent), so the learner still sends the version out exactly once.
    gate, halfway = gate_learner_after_half(monkeypatch)
    with publish() as (publisher, want, total):
        learner = f"127.0.0.1:{publisher.port}"
        procs: dict[str, subprocess.Popen[str]] = {}
        reader = WeightRelay(wait_s=60.0)
        port = reader.serve("127.0.0.1:0")
        reader.registry, reader.advertise = learner, f"127.0.0.1:{port}"
        result: dict[str, Any] = {}
        thread = threading.Thread(target=read_version_into, args=(learner, reader, result))
        try:
            addresses = {}
            for i in range(2):  # registered one after the other: r0 first, then r1
                procs[f"r{i}"], addresses[f"r{i}"] = start(tmp_path, f"r{i}", learner, go=f"go-r{i}")
                (tmp_path / f"go-r{i}").touch()
                deadline = time.monotonic() + 60
                while len(readers(publisher)) < i + 1:
                    assert time.monotonic() < deadline and procs[f"r{i}"].poll() is None, f"r{i} never registered"
                    time.sleep(0.01)
            thread.start()
            assert halfway.wait(120), "r0 never read half the version"
            r1 = f"relay {addresses['r1']} stream"  # the relays' stream, which the registry named
            deadline = time.monotonic() + 120
            while reader.stats.taken.get(r1, 0) == 0:
                assert time.monotonic() < deadline and thread.is_alive(), (result, reader.stats)
                time.sleep(0.01)  # until the reader has part of the version from r1
            procs["r1"].send_signal(signal.SIGKILL)
            procs["r1"].wait(timeout=30)
            gate.set()
            thread.join(timeout=120)
        finally:
            gate.set()
            (tmp_path / "done").touch()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.communicate(timeout=60)
            reader.close()
        assert not thread.is_alive() and "error" not in result, result
        assert result["sha256"] == want
        assert publisher.server.servicer.served_bytes == total, reader.stats  # still one copy out of the learner
        from_r1, from_r0 = reader.stats.taken.get(r1, 0), reader.stats.taken.get(f"relay {addresses['r0']} stream", 0)
        assert from_r1 > 0 and from_r0 > 0 and from_r1 + from_r0 == total, reader.stats
        streams = {a: f"127.0.0.1:{(tmp_path / f'{n}.stream').read_text()}" for n, a in addresses.items()}
        assert reader.streams_of == streams
        assert "primary" not in reader.stats.taken and reader.stats.fallbacks >= 1, reader.stats
        assert readers(publisher) == (addresses["r0"], addresses["r1"], reader.advertise)
        assert reader.stats.upstream == {1: (addresses["r1"], addresses["r0"])}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_stoker_rollout_relay_flags_register_with_the_learner_and_read_from_the_relay_it_names() -> None:
    """``--weights-relay-port/--weights-relay-advertise`` as the operator sets them, parsed by the
    real CLI and wired by ``weight_source``: the second server reads the version from the first."""
    from stoker.cli import build_parser
    from stoker.rollout.cli import relay_problem, weight_source

    from .test_cli import EXAMPLE

    with publish() as (publisher, want, total):
        learner = f"127.0.0.1:{publisher.port}"
        subscribers, stream_ports = [], []
        try:
            for _ in range(2):
                port, stream_port = _free_port(), _free_port()
                stream_ports.append(stream_port)
                argv = ["rollout", "--manifest", str(EXAMPLE), "--host", "127.0.0.1", "--weights", learner,
                        "--weights-relay-port", str(port), "--weights-relay-advertise", f"127.0.0.1:{port}",
                        "--weights-relay-stream-port", str(stream_port)]
                args = build_parser(argv).parse_args(argv)
                assert relay_problem(args) is None
                subscribers.append(weight_source(args, None))
            first, second = subscribers
            for subscriber in subscribers:  # one after the other: the first holds it all when the second reads
                weights: Any = subscriber.fetch(subscriber.latest_version())
                got = dict(zip(weights.manifest.tensors, weights.read_boxes(
                    [(n, tuple((0, d) for d in t.shape)) for n, t in weights.manifest.tensors.items()]
                ), strict=True))
                assert {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in got.items()} == want
            assert first.relay.stats.taken == {"primary": total}
            assert second.relay.stats.upstream == {1: (first.relay.advertise,)}
            assert second.relay.stats.taken == {f"relay {first.relay.advertise} stream": total}
            assert first.relay.stream_server.port == stream_ports[0]
            deadline = time.monotonic() + 30  # its count moves after each send returns, maybe after our read
            while first.relay.stream_server.served_bytes < total and time.monotonic() < deadline:
                time.sleep(0.01)
            assert first.relay.stream_server.served_bytes == total
            assert publisher.server.servicer.served_bytes == total
        finally:
            for subscriber in subscribers:
                subscriber.relay.close()
                subscriber.close()


@pytest.mark.slow
def test_hosts_reading_different_slices_form_one_tree_per_layout_and_each_reads_its_slice_from_its_own() -> None:
    """The hosts of multi-host servers read different boxes (their devices' slices): host k of
    every server joins host k's tree, never one that does not hold its blocks."""
    published = to_hf(init_model(CONFIG, 7, jnp.bfloat16))  # what publish() serves
    with publish() as (publisher, _, _):
        learner = f"127.0.0.1:{publisher.port}"
        relays = [WeightRelay(wait_s=10.0) for _ in range(4)]
        try:
            for relay in relays:
                relay.registry, relay.advertise = learner, f"127.0.0.1:{relay.serve('127.0.0.1:0')}"
            for n, relay in enumerate(relays):  # server 0's hosts 0 and 1, then server 1's
                with WeightSubscriber(address=learner, relay=relay) as subscriber:
                    weights: Any = subscriber.fetch(1)
                    boxes = []
                    for name, tensor in weights.manifest.tensors.items():
                        rows, half = tensor.shape[0], tensor.shape[0] // 2
                        boxes.append((name, ((0, half) if n % 2 == 0 else (half, rows), *((0, d) for d in tensor.shape[1:]))))
                    for (name, box), got in zip(boxes, weights.read_boxes(boxes), strict=True):
                        assert got.tobytes() == published[name][slice(*box[0])].tobytes(), name
            trees = publisher.server.servicer.relays.trees(1)
            assert sorted(trees.values()) == sorted([(relays[0].advertise, relays[2].advertise), (relays[1].advertise, relays[3].advertise)])
            for host in (0, 1):
                root, below = relays[host], relays[host + 2]
                assert set(root.stats.taken) == {"primary"} and below.stats.fallbacks == 0
                assert below.stats.taken == {f"relay {root.advertise} stream": root.stats.taken["primary"]}
            # Each host's slice left the learner once (a block at the halves' seam goes to both trees).
            assert publisher.server.servicer.served_bytes == relays[0].stats.taken["primary"] + relays[1].stats.taken["primary"]
        finally:
            for relay in relays:
                relay.close()
