"""The actor's weight sync: poll the weight channel, load each newer version, and check at once
when a group is about to start on weights older than the version that granted it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from stoker.weights.errors import WeightsError

log = logging.getLogger("stoker.actor")

# How long a granted group may wait for the weights of the version that granted it. Credit opens
# when the learner reports a version, after its weights are published; a group started on the
# version before would be two versions old when trained, and dropped at maxStaleness 1.
CATCH_UP_SECONDS = 2.0


class WeightSource(Protocol):
    def latest_version(self) -> int: ...

    def fetch(self, version: int) -> Mapping[str, np.ndarray]: ...


class LoadsWeights(Protocol):
    @property
    def version(self) -> Any: ...

    async def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None: ...


class WeightSync:
    """``run`` polls every ``poll_seconds`` (with ``between-episodes`` the policy keeps running
    episodes on the weights they started with); ``catch_up`` asks for a check now."""

    def __init__(
        self, weights: WeightSource, loader: LoadsWeights, poll_seconds: float, actor_id: str, on_load: Callable[[], None]
    ):
        self.weights, self.loader, self.poll_seconds, self.actor_id = weights, loader, poll_seconds, actor_id
        self.on_load = on_load  # called after each version is loaded
        self._wanted = asyncio.Event()  # a check now, not at the next poll
        self._waiters: list[asyncio.Future[None]] = []  # answered when a check begun after them ends

    async def run(self) -> None:
        while True:
            waiting, self._waiters = self._waiters, []
            self._wanted.clear()
            try:
                latest = await asyncio.to_thread(self.weights.latest_version)
                if latest > int(self.loader.version):
                    flat = await asyncio.to_thread(self.weights.fetch, latest)
                    await self.loader.load_weights(flat, latest)
                    self.on_load()
                    log.info("actor %s now samples with policy version %d", self.actor_id, latest)
            except WeightsError as exc:
                log.warning("weight sync: %s; retrying", exc)
            for checked in waiting:
                if not checked.done():  # not given up on
                    checked.set_result(None)
            try:
                await asyncio.wait_for(self._wanted.wait(), self.poll_seconds)
            except TimeoutError:
                pass

    async def catch_up(self, version: int) -> None:
        """Start the next group on ``version``'s weights when the loaded ones are older: check the
        weight channel now and wait for that check (at most ``CATCH_UP_SECONDS``)."""
        if int(self.loader.version) >= version:
            return
        checked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(checked)
        self._wanted.set()
        try:
            await asyncio.wait_for(checked, CATCH_UP_SECONDS)
        except TimeoutError:
            log.warning("actor %s: version %d's weights not loaded within %g s; starting on %s",
                        self.actor_id, version, CATCH_UP_SECONDS, self.loader.version)
