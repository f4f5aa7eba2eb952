"""The multi-host rollout server's rules, without a second process: how a sampler call travels,
when hosts count as diverged, and that new weights load only where every host has them.
(tests/rollout/test_multihost.py runs the real thing over two JAX processes.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.distributed import PeerFailure, Processes
from stoker.rollout import hosts
from stoker.rollout.engine import Engine
from stoker.rollout.hosts import LeaderSampler, WeightsDisagree, check_agreement, decode_call, encode_call
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec

from .conftest import CONFIG, MAX_BATCH, weights

OPTIONS: dict[str, Any] = dict(
    seed=0, buckets=(128,), min_batch=MAX_BATCH, session_rows=2 * MAX_BATCH, pin_sessions=True, min_chunk=1
)


@given(
    prompts=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=40), max_size=8),
    sessions=st.lists(st.text(), max_size=8),
    temperature=st.none() | st.floats(0, 4),
)
def test_a_call_arrives_as_it_was_sent(prompts: list[list[int]], sessions: list[str], temperature: float | None) -> None:
    header, received = decode_call(encode_call(hosts.GENERATE, prompts, sessions=sessions, temperature=temperature))
    assert received == prompts
    assert (header["kind"], header["sessions"], header["temperature"]) == (hosts.GENERATE, sessions, temperature)


def test_hosts_that_replay_differently_are_caught() -> None:
    check_agreement(np.asarray([7, 7, 7]))
    with pytest.raises(PeerFailure, match=r"hosts \[2\] replayed"):
        check_agreement(np.asarray([7, 7, 8]))


def test_the_digest_follows_every_call_that_shapes_the_next_program(xla_cache: object) -> None:
    one, two = (Sampler(CONFIG, SamplingSpec(), **OPTIONS) for _ in range(2))
    assert one.bookkeeping_digest() == two.bookkeeping_digest()
    seen = {one.bookkeeping_digest()}
    for sampler in (one, two):
        sampler.generate([[1, 2, 3], [4, 5]], max_new_tokens=3, sessions=["a", "b"])
    assert one.bookkeeping_digest() == two.bookkeeping_digest()  # the same calls, the same state
    seen.add(one.bookkeeping_digest())
    one.end_session("a")
    seen.add(one.bookkeeping_digest())
    assert one.bookkeeping_digest() != two.bookkeeping_digest()
    one.load_weights(weights(1), 1)
    seen.add(one.bookkeeping_digest())
    assert len(seen) == 4


class FakeGroup:
    """Stands in for ``stoker.distributed.share`` on a two-host group whose other host agrees on
    every call but reports ``other_has_weights`` for new weights."""

    def __init__(self, other_has_weights: bool):
        self.other_has_weights = other_has_weights
        self.calls: list[str] = []

    def __call__(self, processes: Processes, flag: int, payload: bytes = b"", *, doing: str, **_: Any) -> Any:
        if payload:
            self.calls.append(decode_call(payload)[0]["kind"])
            return np.asarray([flag, flag]), payload
        return np.asarray([flag, int(self.other_has_weights)]), b""


@pytest.mark.parametrize("other_has_weights", [True, False])
def test_new_weights_load_only_where_every_host_has_them(
    other_has_weights: bool, monkeypatch: pytest.MonkeyPatch, xla_cache: object
) -> None:
    group = FakeGroup(other_has_weights)
    monkeypatch.setattr(hosts, "share", group)
    leader = LeaderSampler(CONFIG, SamplingSpec(), processes=Processes(0, 2), **OPTIONS)
    engine = Engine(leader, max_batch=MAX_BATCH, max_queue=8)
    assert engine.load_weights(weights(1), 1, timeout=60) is other_has_weights
    assert (engine.version, leader.version) == ((1, 1) if other_has_weights else (0, 0))
    assert group.calls == [hosts.LOAD_WEIGHTS]
    if not other_has_weights:
        with pytest.raises(WeightsDisagree, match=r"hosts \[1\] could not fetch policy version 2"):
            leader.load_weights(weights(2), 2)


def test_a_follower_that_cannot_fetch_withholds_its_agreement(monkeypatch: pytest.MonkeyPatch, xla_cache: object) -> None:
    shared: list[int] = []

    def share(processes: Processes, flag: int, payload: bytes = b"", *, doing: str, **_: Any) -> Any:
        shared.append(flag)
        return np.asarray([1, flag]), b""

    def fetch(version: int) -> Any:
        raise LookupError(f"version {version} was pruned")

    monkeypatch.setattr(hosts, "share", share)
    follower = Sampler(CONFIG, SamplingSpec(), **OPTIONS)
    hosts._follow_load(follower, Processes(1, 2), fetch, 3)
    assert shared == [0] and follower.version == 0
    hosts._follow_load(follower, Processes(1, 2), lambda version: weights(version), 3)
    assert shared == [0, 1] and follower.version == 3


def test_a_follower_prefetches_the_newest_weights_so_a_swap_waits_for_no_download(tmp_path: Any) -> None:
    import time

    from stoker.weights.channel import WeightPublisher, WeightsNotFound, WeightSubscriber

    class Counting:
        def __init__(self, inner: WeightSubscriber):
            self.inner, self.fetched = inner, []

        def latest_version(self) -> int:
            return self.inner.latest_version()

        def fetch(self, version: int) -> Any:
            self.fetched.append(version)
            return self.inner.fetch(version)

    with WeightPublisher(directory=tmp_path) as publisher:
        subscriber = Counting(WeightSubscriber(directory=tmp_path))
        prefetcher = hosts.WeightPrefetcher(subscriber, poll_seconds=0.02).start()
        try:
            publisher.publish(1, weights(1))
            deadline = time.monotonic() + 30
            while not subscriber.fetched:
                assert time.monotonic() < deadline, "the prefetcher never fetched version 1"
                time.sleep(0.02)  # polling for the background fetch
            flat = prefetcher.fetch(1)  # held already: no second download
            assert subscriber.fetched == [1]
            assert all(np.array_equal(flat[name], array) for name, array in weights(1).items())
            with pytest.raises(WeightsNotFound):
                prefetcher.fetch(7)  # one it does not hold is fetched, and may not exist
        finally:
            prefetcher.stop()


class Recording:
    """A subscriber that keeps every version handle it returned, to count the bytes read from them."""

    def __init__(self, inner: Any):
        self.inner, self.handles = inner, []

    def latest_version(self) -> int:
        return self.inner.latest_version()

    def fetch(self, version: int) -> Any:
        handle = self.inner.fetch(version)
        self.handles.append(handle)
        return handle

    def bytes_read(self) -> int:
        return sum(handle.stats.bytes_read for handle in self.handles)


def _agreeing(processes: Processes, flag: int, payload: bytes = b"", *, doing: str, **_: Any) -> Any:
    return np.asarray([1, flag]), b""  # the other host has every version


@pytest.mark.parametrize("transport", ["directory", "peer"])
def test_a_follower_reads_its_shards_before_the_swap_and_the_swap_reads_nothing(
    transport: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, xla_cache: object
) -> None:
    from stoker.weights.publish import ShardedPublisher
    from stoker.model.hf import to_hf
    from stoker.model.model import init_model
    from stoker.weights.channel import WeightSubscriber

    monkeypatch.setattr(hosts, "share", _agreeing)
    follower = Sampler(CONFIG, SamplingSpec(), **OPTIONS)
    with ShardedPublisher(directory=str(tmp_path), address="127.0.0.1:0", processes=Processes(), block_bytes=256) as publisher:
        where = {"directory": tmp_path} if transport == "directory" else {"address": f"127.0.0.1:{publisher.port}"}
        with WeightSubscriber(**where) as inner:  # type: ignore[arg-type]
            subscriber = Recording(inner)
            prefetcher = hosts.WeightPrefetcher(subscriber, poll_seconds=0.01, layout=follower.weight_layout())
            for version in (1, 2):  # the second replaces the first: one version held
                prefetcher.staged.clear()
                publisher.publish(version, init_model(CONFIG, seed=version))
                if version == 1:
                    prefetcher.start()
                assert prefetcher.staged.wait(60) and prefetcher.held() == version, f"version {version} was never staged"
            try:
                read = subscriber.bytes_read()
                assert read >= sum(a.nbytes for a in weights(2).values())  # this host's slices (here: all) were read
                hosts._follow_load(follower, Processes(1, 2), prefetcher.fetch, 2)
                assert subscriber.bytes_read() == read  # the swap read nothing more
                assert follower.version == 2
                for name, array in to_hf(follower._model).items():
                    assert array.tobytes() == weights(2)[name].tobytes(), name
            finally:
                prefetcher.stop()


def test_a_corrupt_shard_is_refused_at_prefetch_and_the_model_keeps_its_weights(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, xla_cache: object
) -> None:
    from stoker.weights.publish import ShardedPublisher
    from stoker.model.hf import to_hf
    from stoker.model.model import init_model
    from stoker.weights.channel import WeightsCorrupt, WeightSubscriber

    shared: list[int] = []

    def share(processes: Processes, flag: int, payload: bytes = b"", *, doing: str, **_: Any) -> Any:
        shared.append(flag)
        return np.asarray([1, flag]), b""

    monkeypatch.setattr(hosts, "share", share)
    follower = Sampler(CONFIG, SamplingSpec(), **OPTIONS)
    before = to_hf(follower._model)
    with ShardedPublisher(directory=str(tmp_path), processes=Processes(), block_bytes=256) as publisher:
        publisher.publish(1, init_model(CONFIG, seed=1))
    shard = next(tmp_path.glob("shards-000000000001-*/p00000/model.layers.0.mlp.down_proj.weight@0"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with WeightSubscriber(directory=tmp_path) as subscriber:
        prefetcher = hosts.WeightPrefetcher(subscriber, poll_seconds=0.01, layout=follower.weight_layout()).start()
        try:
            assert prefetcher.staged.wait(60), "the prefetcher never tried version 1"
            assert prefetcher.held() is None
            with pytest.raises(WeightsCorrupt, match="crc32"):
                prefetcher.fetch(1)  # refused at prefetch: the swap's fetch fails the same way, before any agreement
            hosts._follow_load(follower, Processes(1, 2), prefetcher.fetch, 1)
        finally:
            prefetcher.stop()
    assert shared == [0] and follower.version == 0  # this host withheld its agreement
    for name, array in to_hf(follower._model).items():
        assert array.tobytes() == before[name].tobytes(), name


def test_the_server_reads_sharded_weights_before_handing_them_to_the_engines_swap(
    serve: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stoker.model.model import init_model
    from stoker.weights.channel import WeightSubscriber

    from .conftest import make_engine

    from stoker.distributed import Processes
    from stoker.weights.publish import ShardedPublisher
    from stoker.model.hf import to_hf

    with ShardedPublisher(directory=str(tmp_path), processes=Processes(), block_bytes=256) as publisher:
        publisher.publish(1, init_model(CONFIG, seed=1))
    handles: list[Any] = []
    with WeightSubscriber(directory=tmp_path) as subscriber:
        fetch = subscriber.fetch
        monkeypatch.setattr(subscriber, "fetch", lambda version: handles.append(fetch(version)) or handles[-1])
        engine = make_engine()
        read_at_swap: list[int] = []
        swap = engine.sampler.load_weights

        def counting_swap(flat: object, version: int) -> None:
            read_at_swap.append(handles[-1].stats.bytes_read)
            swap(flat, version)  # type: ignore[arg-type]
            read_at_swap.append(handles[-1].stats.bytes_read)

        monkeypatch.setattr(engine.sampler, "load_weights", counting_swap)
        server = serve(engine, weights=subscriber)
        assert server.engine.version == 1
    assert len(handles) == 1 and read_at_swap[0] > 0 and read_at_swap[0] == read_at_swap[1]  # all read before the swap
    for name, array in to_hf(engine.sampler._model).items():
        assert array.tobytes() == weights(1)[name].tobytes(), name
