"""One sampled turn, as every sampler returns it (``Sampled``), and the protocol an episode samples
through (``Policy``): the in-process ``BatchedSampler`` (``stoker.actor.policy``), a remote rollout
server (``stoker.rollout.client``) and a learner's teacher all answer it."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Sampled:
    """One model turn: the ids exactly as sampled, their log-probs, and the policy version."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended by sampling a stop token (else by the token limit)
    version: int


class PolicyError(Exception):
    """The policy could not answer a turn (e.g. its rollout server stayed unreachable); the
    episode fails with this reason and its group is handled by ``buffer.failedGroupPolicy``."""


class Policy(Protocol):
    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: Hashable = None
    ) -> Sampled: ...

    async def end_session(self, session: Hashable) -> None:
        """The conversation ``session`` is over (no more turns)."""
