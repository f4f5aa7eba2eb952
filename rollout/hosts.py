"""One rollout server over every host of a multi-host slice: host 0 serves, the others follow.

Host 0 (the primary) runs the gRPC server and the engine. Every call its engine makes on the
sampler -- a segment, a session's end, new weights -- is first sent to the other hosts, and each
makes the same call on its own ``Sampler``. A sampler's bookkeeping (session rows, prefix donors,
random keys) is a deterministic function of its calls, so every host enters the same XLA programs
with the same inputs in the same order, and one mesh spans all their chips.

Weights are not broadcast: each host follows the weight channel itself (``WeightPrefetcher``,
fetching as the primary does, so a swap waits for no download), and an announced version is
loaded only where every host has it (otherwise none loads it and the primary asks again). A lost host, or any failed collective, ends the server (``PeerFailure``):
the JobSet restarts the slice, and the actors retry their turns elsewhere. So does a host whose
sampler state differs from the primary's, which every call checks first.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from stoker.distributed import PeerFailure, Processes, collective, share
from stoker.hfconfig import CheckpointError
from stoker.rollout.sampling import Generation, Sampler
from stoker.weights.errors import WeightsCorrupt, WeightsError, WeightsNotFound

log = logging.getLogger("stoker.rollout")

GENERATE, END_SESSION, LOAD_WEIGHTS, STOP = "generate", "end-session", "load-weights", "stop"
_HEADER = struct.Struct("<I")


class WeightsDisagree(WeightsNotFound):
    """Not every host could fetch the announced version; none loads it (the primary asks for the
    latest again)."""


def check_agreement(digests: np.ndarray) -> None:
    """Every host's sampler is in the state the primary's is in (``Sampler.bookkeeping_digest``)
    before the next call; a host that diverged would run other programs than the rest (and
    deadlock them) or sample from the wrong cache rows, so the server stops instead."""
    differing = [int(i) for i in np.flatnonzero(digests != digests[0])]
    if differing:
        raise PeerFailure(f"hosts {differing} replayed the sampler's calls differently from host 0; restarting the server")


def encode_call(kind: str, prompts: Sequence[Sequence[int]] = (), **fields: Any) -> bytes:
    """One sampler call as bytes: a JSON header, then every prompt's ids as int32."""
    header = json.dumps({"kind": kind, "lengths": [len(p) for p in prompts], **fields}).encode()
    ids = np.fromiter((t for p in prompts for t in p), np.int32)
    return _HEADER.pack(len(header)) + header + ids.tobytes()


def decode_call(data: bytes) -> tuple[dict[str, Any], list[list[int]]]:
    (size,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + size])
    ids = np.frombuffer(data, np.int32, offset=_HEADER.size + size).tolist()
    prompts, at = [], 0
    for length in header["lengths"]:
        prompts.append(ids[at : at + length])
        at += length
    return header, prompts


class LeaderSampler(Sampler):
    """The primary's sampler: each mutating call is announced to the followers first. The
    engine drives it as any ``Sampler`` (it must not call its own public methods internally, or
    the followers would replay calls the primary never announced)."""

    def __init__(self, *args: Any, processes: Processes, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.processes = processes

    def _announce(self, call: bytes) -> None:
        flags, _ = share(self.processes, self.bookkeeping_digest(), call, doing="announcing a sampler call")
        check_agreement(flags)

    def generate(self, prompts: list[list[int]], **options: Any) -> list[Generation]:
        self._announce(encode_call(GENERATE, prompts, **options))  # every option is JSON: ids, names, numbers
        with collective("generating"):
            return super().generate(prompts, **options)

    def end_session(self, session: Any) -> None:
        self._announce(encode_call(END_SESSION, session=session))
        super().end_session(session)

    def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None:
        """Raises ``WeightsDisagree`` (nothing loaded anywhere) when a host lacks ``version``."""
        self._announce(encode_call(LOAD_WEIGHTS, version=version))
        flags, _ = share(self.processes, 1, doing="agreeing on new weights")
        if not flags.all():
            missing = [int(i) for i in np.flatnonzero(flags == 0)]
            raise WeightsDisagree(f"hosts {missing} could not fetch policy version {version}")
        with collective("loading weights"):
            super().load_weights(flat, version)

    def stop_followers(self) -> None:
        """Let every follower return from ``follow`` (call once the engine has stopped)."""
        self._announce(encode_call(STOP))


def follow(sampler: Sampler, processes: Processes, fetch: Callable[[int], Mapping[str, np.ndarray]] | None) -> None:
    """Make the primary's sampler calls on ``sampler`` until it stops; ``fetch(version)`` gets
    announced weights from the channel (raising when it cannot). Raises ``PeerFailure`` when the
    primary (or another host) is lost."""
    while True:
        flags, data = share(processes, sampler.bookkeeping_digest(), doing="waiting for the primary's next call")
        check_agreement(flags)
        call, prompts = decode_call(data)
        kind = call["kind"]
        if kind == STOP:
            log.info("the primary stopped; this host stops too")
            return
        if kind == GENERATE:
            options = {k: v for k, v in call.items() if k not in ("kind", "lengths")}
            try:
                with collective("generating"):
                    sampler.generate(prompts, **options)
            except (ValueError, KeyError) as exc:  # the primary's call fails the same way, before any program runs
                log.debug("replayed call failed as on the primary: %s", exc)
        elif kind == END_SESSION:
            sampler.end_session(call["session"])
        elif kind == LOAD_WEIGHTS:
            _follow_load(sampler, processes, fetch, int(call["version"]))
        else:
            raise ValueError(f"unknown sampler call {kind!r} from the primary")


def _follow_load(
    sampler: Sampler, processes: Processes, fetch: Callable[[int], Mapping[str, np.ndarray]] | None, version: int
) -> None:
    flat: Mapping[str, np.ndarray] | None = None
    try:
        if fetch is None:
            raise LookupError("this host has no weight channel")
        flat = fetch(version)
    except Exception as exc:  # noqa: BLE001 - any failure here only withholds this host's agreement
        log.warning("could not fetch policy version %d: %s", version, exc)
    flags, _ = share(processes, int(flat is not None), doing="agreeing on new weights")
    if flags.all() and flat is not None:
        with collective("loading weights"):
            sampler.load_weights(flat, version)


class WeightPrefetcher:
    """A follower's copy of the newest published weights, fetched in the background while the
    primary fetches its own, so that when the primary announces the version the swap waits for
    no download. Sharded weights are staged: this host's slices (``layout``, the sampler's
    ``weight_layout()``) read and checksummed into host memory, so the swap only places them on
    the devices. At most one version is held: the older one is dropped before the next is read.

    ``fetch(version)`` answers from it, or stages a version it does not hold right then; either
    way every read and check happens before the hosts agree, so a bad shard withholds this
    host's agreement instead of failing a swap the others make."""

    def __init__(self, subscriber: Any, poll_seconds: float, layout: Any = None):
        self.subscriber = subscriber
        self.poll_seconds = poll_seconds
        self.layout = layout
        self._newest: tuple[int, Mapping[str, np.ndarray]] | None = None
        self._refused: tuple[int, Exception] | None = None  # a version whose bytes failed their checks
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one version read at a time (background or on demand)
        self._stop = threading.Event()
        self.staged = threading.Event()  # set whenever a version was staged (or refused): for tests and logs
        self._thread = threading.Thread(target=self._follow, name="rollout-prefetch", daemon=True)

    def start(self) -> WeightPrefetcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def held(self) -> int | None:
        with self._lock:
            return None if self._newest is None else self._newest[0]

    def fetch(self, version: int) -> Mapping[str, np.ndarray]:
        with self._reading:
            with self._lock:
                if self._newest is not None and self._newest[0] == version:
                    return self._newest[1]
                if self._refused is not None and self._refused[0] == version:
                    raise self._refused[1]
            return self._stage(version)

    def _stage(self, version: int) -> Mapping[str, np.ndarray]:
        """Fetch ``version`` and, when sharded, read its slices (call with ``_reading`` held)."""
        with self._lock:
            self._newest = None  # bound host memory to one version: drop the old before reading
        try:
            flat = self.subscriber.fetch(version)
            stage = getattr(flat, "stage", None)
            if callable(stage) and self.layout is not None:
                flat = stage(self.layout)
        except (WeightsCorrupt, CheckpointError) as exc:  # the same bytes fail again: refuse the version
            with self._lock:
                self._refused = (version, exc)
            self.staged.set()
            raise
        with self._lock:
            self._newest = (version, flat)
        self.staged.set()
        return flat

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                latest = self.subscriber.latest_version()
                with self._lock:
                    held = -1 if self._newest is None else self._newest[0]
                    refused = -1 if self._refused is None else self._refused[0]
                if latest > held and latest != refused:
                    with self._reading:
                        if self.held() != latest:
                            self._stage(latest)
            except (WeightsError, ValueError) as exc:  # ValueError: CheckpointError, weights that do not fit
                log.warning("weight prefetch: %s; retrying", exc)
