"""The weight channel's errors, shared by the single-blob (``stoker.weights.channel``) and the
sharded (``stoker.weights.shards``) formats."""

from __future__ import annotations


class WeightsError(Exception):
    """Base of the weight channel's errors."""


class WeightsNotFound(WeightsError):
    """The version was never published or has been pruned; fetch the latest instead."""


class WeightsCorrupt(WeightsError):
    """The bytes received do not match the published size/checksum (truncated or damaged)."""


class WeightsUnavailable(WeightsError):
    """The publisher cannot be reached right now; retrying later may succeed."""
