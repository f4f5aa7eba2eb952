"""Sharded weights over the learner processes' plain-TCP streams (stoker.weights.shard_stream), over
loopback: bit-exact by default through the subscriber; a stream server killed mid-transfer and one
sending a flipped byte both leave the reader bit-exact from its fallback; a wrong token refused;
a tensor of many reads lands in one buffer."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from stoker.distributed import Processes
from stoker.weights.publish import ShardedPublisher
from stoker.model.hf import to_hf
from stoker.model.model import init_model
from stoker.weights.shard_service import PeerShards
from stoker.weights.shard_stream import StreamRefused, StreamServer, StreamShards, staged_lookup
from stoker.weights.shards import ShardDirectory, ShardedWeights, ShardManifest, ShardsCorrupt, as_bytes, checksums, crc32
from stoker.weights.channel import WeightSubscriber
from stoker.spec import TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
WORKER = Path(__file__).with_name("stream_worker.py")


@contextlib.contextmanager
def publish(directory: Path | None = None, token: str | None = None) -> Iterator[tuple[ShardedPublisher, ShardManifest, dict[str, np.ndarray]]]:
    """One learner process's servers (gRPC + stream) holding version 1 (many 256-byte blocks)."""
    model = init_model(CONFIG, 7, jnp.bfloat16)
    with ShardedPublisher(directory=str(directory) if directory else None, address="127.0.0.1:0", processes=Processes(),
                          block_bytes=256, auth_token=token) as publisher:
        manifest = publisher.publish(1, model)
        assert manifest is not None
        yield publisher, manifest, to_hf(model)


def read_all(manifest: ShardManifest, source: object) -> dict[str, np.ndarray]:
    weights = ShardedWeights(manifest, source)  # type: ignore[arg-type]
    names = list(manifest.tensors)
    return dict(zip(names, weights.read_boxes([(n, tuple((0, d) for d in manifest.tensors[n].shape)) for n in names]), strict=True))


def assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].tobytes() == array.tobytes(), name


def test_the_subscriber_reads_a_sharded_version_over_the_streams_bit_exact() -> None:
    with publish() as (publisher, manifest, want):
        assert manifest.streams == (publisher.stream_address,)
        with WeightSubscriber(address=f"127.0.0.1:{publisher.port}") as subscriber:
            assert subscriber.latest_version() == 1
            weights = subscriber.fetch(1)
            got = {name: weights[name] for name in want}
            source = weights.source  # type: ignore[attr-defined]
        assert_bit_exact(got, want)
        assert isinstance(source, StreamShards) and source.fallbacks == 0
        assert publisher.stream.served_bytes == manifest.nbytes  # every byte over the stream...
        assert publisher.server.servicer.served_bytes == 0  # ...none over gRPC ReadShard


@contextlib.contextmanager
def flipping_one_byte(publisher: ShardedPublisher, manifest: ShardManifest) -> Iterator[tuple[ShardManifest, int]]:
    """A stream server that sends the largest shard with a byte of its block 1 flipped (256-byte
    blocks) and the rest as staged: the manifest naming it as the stream, and that shard's bytes."""
    shard = max((s for t in manifest.tensors.values() for s in t.shards), key=lambda s: len(s.checksums))
    bad = bytearray(as_bytes(publisher.server.servicer.array(1, shard.key)))
    bad[300] ^= 0x01
    staged = staged_lookup(publisher.server.servicer.array)

    def lying(version: int, process: int, key: str) -> memoryview | None:
        return memoryview(bytes(bad)) if key == shard.key else staged(version, process, key)

    liar = StreamServer("127.0.0.1:0", lying)
    try:
        yield dataclasses.replace(manifest, streams=(f"127.0.0.1:{liar.port}",)), len(bad)
    finally:
        liar.close()


def test_a_stream_server_sending_a_flipped_byte_is_caught_and_the_reader_reads_the_rest_over_grpc() -> None:
    with publish() as (publisher, manifest, want):
        with flipping_one_byte(publisher, manifest) as (lied, bad_bytes):
            streams = StreamShards(fallback=PeerShards())
            got = read_all(lied, streams)
        assert_bit_exact(got, want)
        assert streams.fallbacks == 1
        # Block 0 of the bad shard (verified) came over the stream; from its block 1 on, gRPC.
        assert publisher.server.servicer.served_bytes == bad_bytes - 256
        assert streams.streamed_bytes == manifest.nbytes - (bad_bytes - 256)


def test_a_wrong_token_is_refused_by_the_stream_and_nothing_is_read() -> None:
    with publish(token="right") as (publisher, manifest, want):
        shard = next(iter(manifest.tensors.values())).shards[0]
        size = len(as_bytes(publisher.server.servicer.array(1, shard.key)))
        for token in ("wrong", None):
            # Final even with a fallback: the same token would be refused there too.
            with pytest.raises(StreamRefused, match="refused our token"):
                StreamShards(token, fallback=PeerShards()).read(manifest, shard, 0, size)
        assert publisher.stream.served_bytes == 0 and publisher.server.servicer.served_bytes == 0
        got = StreamShards("right").read(manifest, shard, 0, size)
        assert bytes(got) == bytes(as_bytes(publisher.server.servicer.array(1, shard.key)))


@pytest.mark.timeout(120)
def test_a_stream_server_killed_mid_transfer_leaves_the_reader_to_finish_over_grpc_bit_exact(tmp_path: Path) -> None:
    with publish(tmp_path / "weights") as (publisher, manifest, want):
        # A separate process serving the shared directory's files (sendfile); after half the
        # version it sends half of each request and stalls, and is then SIGKILLed.
        proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(tmp_path / "weights"), str(manifest.nbytes // 2)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "stream.port").exists():
                assert proc.poll() is None, proc.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the stream worker never listened"
                time.sleep(0.02)
            streams = StreamShards(fallback=PeerShards())
            relocated = dataclasses.replace(manifest, streams=(f"127.0.0.1:{(tmp_path / 'stream.port').read_text()}",))
            result: dict[str, object] = {}

            def reader() -> None:
                try:
                    result["got"] = read_all(relocated, streams)
                except BaseException as err:  # noqa: BLE001 - reported below
                    result["error"] = err

            thread = threading.Thread(target=reader)
            thread.start()
            while not (tmp_path / "stalled").exists():
                assert thread.is_alive() and time.monotonic() < deadline, result
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            thread.join(60)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        assert "error" not in result, result.get("error")
        assert_bit_exact(result["got"], want)  # type: ignore[arg-type]
        assert streams.fallbacks >= 1
        assert streams.streamed_bytes >= manifest.nbytes // 2  # half the version and part of the cut reads
        assert streams.streamed_bytes + publisher.server.servicer.served_bytes == manifest.nbytes


@pytest.mark.parametrize("run_bytes", [16 << 20, 512], ids=["one-run", "many-runs"])
def test_any_box_reads_bit_exact_over_every_transport_however_the_reads_are_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int
) -> None:
    from stoker.weights import shard_read, shards

    monkeypatch.setattr(shard_read, "RUN_BYTES", run_bytes)  # 512: a box's blocks come from several reads
    rng = np.random.default_rng(0)
    with publish(tmp_path / "weights") as (publisher, manifest, want):
        sources = {"stream": StreamShards(fallback=PeerShards()), "grpc": PeerShards(),
                   "directory": shards.ShardDirectory(tmp_path / "weights")}
        for name, source in sources.items():
            weights = ShardedWeights(manifest, source)  # type: ignore[arg-type]
            wanted = []
            for tensor, array in want.items():
                lo = [int(rng.integers(0, n)) for n in array.shape]
                wanted.append((tensor, tuple((a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, array.shape, strict=True))))
            for (tensor, box), got in zip(wanted, weights.read_boxes(wanted), strict=True):
                expected = want[tensor][tuple(slice(a, b) for a, b in box)]
                assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), (name, tensor, box)


def test_a_stream_port_nobody_answers_on_is_tried_once_and_the_reads_go_over_grpc() -> None:
    import socket

    with socket.socket() as closed:  # a port bound but never listened on: connections are refused
        closed.bind(("127.0.0.1", 0))
        with publish() as (publisher, manifest, want):
            streams = StreamShards(fallback=PeerShards())
            weights = ShardedWeights(dataclasses.replace(manifest, streams=(f"127.0.0.1:{closed.getsockname()[1]}",)), streams, threads=1)
            names = list(manifest.tensors)
            got = dict(zip(names, weights.read_boxes([(n, tuple((0, d) for d in manifest.tensors[n].shape)) for n in names]), strict=True))
            assert publisher.server.servicer.served_bytes == manifest.nbytes
    assert_bit_exact(got, want)
    assert streams.fallbacks == 1 and streams.streamed_bytes == 0  # then skipped while it is marked dead


def test_a_pooled_connection_the_server_closed_while_idle_is_reopened_not_counted_a_failure() -> None:
    with publish() as (publisher, manifest, want):
        server = StreamServer("127.0.0.1:0", staged_lookup(publisher.server.servicer.array), idle_s=0.2)
        try:
            relocated = dataclasses.replace(manifest, streams=(f"127.0.0.1:{server.port}",))
            streams = StreamShards(fallback=PeerShards())
            shard = next(iter(manifest.tensors.values())).shards[0]
            size = len(as_bytes(publisher.server.servicer.array(1, shard.key)))
            first = bytes(streams.read(relocated, shard, 0, size))
            deadline = time.monotonic() + 30
            while server.open_connections():  # the server drops the idle connection; ours stays pooled
                assert time.monotonic() < deadline, "the server kept an idle connection open"
                time.sleep(0.01)
            again = bytes(streams.read(relocated, shard, 0, size))
        finally:
            server.close()
        assert first == again == bytes(as_bytes(publisher.server.servicer.array(1, shard.key)))
        assert streams.fallbacks == 0 and publisher.server.servicer.served_bytes == 0


def test_crc32_gives_zlibs_values_so_published_manifests_stay_valid() -> None:
    data = np.random.default_rng(3).integers(0, 256, size=(5 << 20) + 7, dtype=np.uint8)
    for size in (0, 1, 255, 4096, len(data)):
        assert crc32(memoryview(data)[:size]) == zlib.crc32(memoryview(data)[:size])
    rows = data[: 1000 * 64].reshape(1000, 64)
    assert checksums(rows, 100) == tuple(zlib.crc32(rows[i : i + 100].tobytes()) for i in range(0, 1000, 100))


@pytest.mark.parametrize("transport", ["stream", "directory"])
def test_a_tensor_of_many_reads_lands_in_one_buffer_with_no_assembly_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    from stoker.weights import shard_read

    monkeypatch.setattr(shard_read, "RUN_BYTES", 512)  # two 256-byte blocks per read
    with publish(tmp_path / "weights") as (_, manifest, want):
        source = StreamShards() if transport == "stream" else ShardDirectory(tmp_path / "weights")
        weights = ShardedWeights(manifest, source)  # type: ignore[arg-type]
        got = read_all(manifest, source)
        assert_bit_exact(got, want)
        weights.read_boxes([(name, tuple((0, n) for n in manifest.tensors[name].shape)) for name in manifest.tensors])
        assert weights.stats.reads > 2 * len(manifest.tensors)  # most tensors took several reads
        for name, array in got.items():
            if manifest.tensors[name].nbytes > 512:  # several reads, received in place: a view, not an assembled copy
                assert not array.flags.owndata and array.flags.writeable, name


def test_a_stream_that_fails_mid_read_is_finished_from_the_directory_into_the_same_buffer(tmp_path: Path) -> None:
    with publish(tmp_path / "weights") as (publisher, manifest, want):
        with flipping_one_byte(publisher, manifest) as (lied, bad_bytes):
            streams = StreamShards(fallback=ShardDirectory(tmp_path / "weights"))
            got = read_all(lied, streams)
        assert_bit_exact(got, want)
        assert streams.fallbacks == 1 and streams.streamed_bytes == manifest.nbytes - (bad_bytes - 256)


def test_a_shard_file_cut_short_is_reported_corrupt_not_read_as_zeros(tmp_path: Path) -> None:
    with publish(tmp_path / "weights") as (_, manifest, _want):
        directory = ShardDirectory(tmp_path / "weights")
        shard = max((s for t in manifest.tensors.values() for s in t.shards), key=lambda s: len(s.checksums))
        path = tmp_path / "weights" / manifest.folder / f"p{shard.process:05d}" / shard.key
        path.write_bytes(path.read_bytes()[:-100])
        with pytest.raises(ShardsCorrupt, match="short"):
            read_all(manifest, directory)


def test_a_closed_stream_server_leaves_no_thread_behind_and_its_port_refuses() -> None:
    def acceptors() -> int:
        return sum(t.name == "weight-stream-accept" for t in threading.enumerate())

    before = acceptors()
    for _ in range(3):
        server = StreamServer("127.0.0.1:0", lambda version, process, key: None)
        assert acceptors() == before + 1
        server.close()
        assert acceptors() == before
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_sharded_weights_over_unix_sockets_gRPC_and_stream_bit_exact(tmp_path: Path) -> None:
    """A host with no inet sockets: the learner process's gRPC server and its stream on unix
    sockets side by side; the subscriber reads every byte over the stream."""
    model = init_model(CONFIG, 7, jnp.bfloat16)
    address = f"unix://{tmp_path}/weights.sock"
    with ShardedPublisher(address=address, processes=Processes(), block_bytes=256) as publisher:
        manifest = publisher.publish(1, model)
        assert manifest is not None
        assert publisher.address == address and publisher.port == 0
        assert manifest.streams == (f"unix://{tmp_path}/weights.stream.sock",)
        with WeightSubscriber(address=address) as subscriber:
            weights = subscriber.fetch(subscriber.latest_version())
            got = {name: weights[name] for name in manifest.tensors}
            source = weights.source  # type: ignore[attr-defined]
        assert_bit_exact(got, to_hf(model))
        assert isinstance(source, StreamShards) and source.fallbacks == 0
        assert publisher.stream is not None and publisher.stream.served_bytes == manifest.nbytes
