"""Which spec edits restart which pods: the config hash each component's pod template carries.

Actor and buffer pods read the job file when they start, so a change to a field one of them reads
must roll its pods (the hash is the ``stoker.dev/config-hash`` annotation of the pod template);
a change to anything else must not. The buffer takes a few fields live instead
(``LIVE_BUFFER_FIELDS``): the operator sends them with the ``Configure`` RPC, and a restarted
buffer reads them from the job file, which is kept current either way.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from stoker.operator.observe import StatsSnapshot
from stoker.spec import RLJobSpec

Paths = tuple[tuple[str, ...], ...]


def config_hash(spec: RLJobSpec, *, include: Paths | None = None, ignore: Paths = ()) -> str:
    """A short digest of the spec's ``include`` fields (all when None), minus ``ignore``."""
    full = spec.model_dump(by_alias=True, mode="json")
    data: dict[str, Any] = full if include is None else {}
    for path in include or ():
        source: Any = full
        target = data
        for part in path[:-1]:
            source = source[part]
            target = target.setdefault(part, {})
        target[path[-1]] = source[path[-1]]
    for path in ignore:
        node = data
        for part in path[:-1]:
            node = node[part]
        node.pop(path[-1], None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


# The spec fields each component reads when it starts (stoker.actor.settings and the model and
# tokenizer actors load; stoker.buffer.settings): a change to one rolls that component's pods,
# through the config-hash annotation. Edits elsewhere (the learner's and algorithm's fields, the
# operator's own scaling fields, suspend) leave them running; tests/operator/test_spec_edits.py
# checks each list against what the components' settings really read.
ACTOR_CONFIG_FIELDS: Paths = (
    ("model",), ("environment",), ("actors",), ("buffer", "groupSize"),
    ("learner", "sequenceBuckets"), ("learner", "compilationCacheDir"), ("seed",),
)
BUFFER_CONFIG_FIELDS: Paths = (("buffer",), ("learner", "batchGroups"))
# Scaling is applied by patching replicas, never by rolling pods.
ACTOR_HASH_IGNORES: Paths = (("actors", "replicas"), ("actors", "minReplicas"), ("actors", "maxReplicas"))

# Buffer fields applied without a restart: the operator calls Configure whenever the value the
# buffer reports in Stats differs from the spec's (level-based, so a call lost to a buffer restart
# or a network error is made again on the next observation).
LIVE_BUFFER_FIELDS: Paths = (("buffer", "capacity"), ("buffer", "maxStaleness"))
# Configure's (and StatsSnapshot's) name for each, and the spec's.
LIVE_SPEC_NAMES = {"capacity": "buffer.capacity", "max_staleness": "buffer.maxStaleness"}


def live_buffer_changes(spec: RLJobSpec, stats: StatsSnapshot) -> dict[str, int]:
    """The ``Configure`` arguments that bring the buffer to the spec: fields it reports otherwise.

    A buffer that reports no ``max_staleness`` predates Configure and is left alone."""
    if stats.max_staleness is None:
        return {}
    wanted = {"capacity": spec.buffer.capacity, "max_staleness": spec.buffer.max_staleness}
    reported = {"capacity": stats.capacity, "max_staleness": stats.max_staleness}
    return {k: v for k, v in wanted.items() if reported[k] != v}
