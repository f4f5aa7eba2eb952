"""Which spec edits restart which pods: the config hash each component's pod template carries.

Actor and buffer pods read the job file when they start, so a change to a field one of them reads
must roll its pods (the hash is the ``stoker.dev/config-hash`` annotation of the pod template);
a change to anything else must not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
