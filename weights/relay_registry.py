"""Who relays to whom: the learner's weights server arranges the rollout servers reading a sharded
version into a tree, so its egress stays about one copy of the version however many read it.

A relaying server registers (``Relays`` RPC, ``RelayRegistry.join``) just before it reads a
version, with a digest of the blocks it reads (its *layout*: servers of the same mesh read the
same blocks) and the address its relay serves them at. Servers of one (version, layout) are
numbered in the order they register and placed as a heap of fan-out ``fanout``: member ``i``
reads from member ``(i - 1) // fanout``; member 0 reads from the learner. The answer names the
parent and then its ancestors (``ancestors`` in all), nearest first: a reader whose parent dies
mid-transfer reads on from the grandparent, which already holds at least as much, and only past
the last named relay from the learner (``RelayedSource``'s fallback). A server that is gone by
the next version does not register for it, so each version's tree holds only live readers.

Fan-out 1 (a chain) is the default: each relay then sends one copy, so no server's egress is
shared and the version moves at the slowest hop's rate, plus one block per hop of pipeline
delay (docs/sizing.md, "How fast new weights reach the rollout tier"); a larger fan-out trades
that rate for fewer hops.

Registration lives on the primary learner process's server alone: it is the address every
reader already asks for ``Latest`` and the manifest (the ``<job>-weights`` Service selects the
learner's first host), and one place must number the servers for the tree to be one tree.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

FANOUT = 1
ANCESTORS = 2  # relays named to a reader: its parent, then the parent's parent
KEEP_VERSIONS = 4  # versions whose trees are remembered (a late reader of an older one still joins)


def upstream_positions(position: int, fanout: int = FANOUT, ancestors: int = ANCESTORS) -> tuple[int, ...]:
    """The positions member ``position`` reads from, nearest first (none for the root)."""
    if fanout < 1 or ancestors < 0:
        raise ValueError(f"fan-out {fanout} and ancestors {ancestors}: expected fan-out >= 1, ancestors >= 0")
    out: list[int] = []
    while position > 0 and len(out) < ancestors:
        position = (position - 1) // fanout
        out.append(position)
    return tuple(out)


class RelayRegistry:
    """The trees of relaying rollout servers, one per (version, layout)."""

    def __init__(self, fanout: int = FANOUT, ancestors: int = ANCESTORS, keep: int = KEEP_VERSIONS):
        upstream_positions(0, fanout, ancestors)  # validates
        self.fanout, self.ancestors, self.keep = fanout, ancestors, keep
        self._lock = threading.Lock()
        self._trees: OrderedDict[int, dict[str, list[str]]] = OrderedDict()
        self._streams: dict[int, dict[str, str]] = {}  # per version: a relay's plain-TCP stream address

    def join(self, version: int, layout: str, address: str, stream: str = "") -> tuple[str, ...]:
        """Place ``address`` among the readers of ``version`` in ``layout`` (again: the same place)
        and return the relays it reads from, nearest first. ``stream``: where it also serves the
        blocks over the shard stream (``streams`` names it to the readers below)."""
        if not address or not layout:
            raise ValueError("a relay registers with its layout digest and its address")
        with self._lock:
            trees = self._trees.get(version)
            if trees is None:
                trees = self._trees[version] = {}
                for old in sorted(self._trees)[: max(0, len(self._trees) - self.keep)]:
                    del self._trees[old]  # the oldest versions' trees
                    self._streams.pop(old, None)
                if version not in self._trees:
                    return ()  # older than every remembered version: read from the learner
            if stream:
                self._streams.setdefault(version, {})[address] = stream
            members = trees.setdefault(layout, [])
            if address not in members:
                members.append(address)
            return tuple(members[p] for p in upstream_positions(members.index(address), self.fanout, self.ancestors))

    def streams(self, version: int, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """Each relay's stream address for ``version`` ("" where it registered none)."""
        with self._lock:
            known = self._streams.get(version, {})
            return tuple(known.get(a, "") for a in addresses)

    def trees(self, version: int) -> dict[str, tuple[str, ...]]:
        """Each layout's readers of ``version`` in the order they registered."""
        with self._lock:
            return {layout: tuple(members) for layout, members in self._trees.get(version, {}).items()}
