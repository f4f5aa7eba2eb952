"""CEL versions of the spec's cross-field rules, built from the same tables as the Python checks.

``stoker.spec_rules.CEL_RULES`` attaches these to the CRD so the API server refuses what
``cross_field_problems`` and ``stoker validate`` refuse. Only standard CEL plus ``split`` (from
the strings library Kubernetes enables for CRD rules) is used. Object-valued fields get no
defaults from the API server, so every read through an optional object goes through ``opt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.jobname import DNS_LABEL_MAX, FIXED_OVERHEAD, ROLLOUT_FIXED_OVERHEAD
from stoker.tpu import ACCELERATORS, CHIPS_PER_HOST_2D_MULTI, CHIPS_PER_HOST_3D, SINGLE_HOST_MAX_CHIPS_2D, SMALL_3D

# A positive multiple of 4 without leading zeros (the topology pattern already forbids those):
# 4, 8, or a number whose last two digits are a multiple of 4.
MULTIPLE_OF_4 = "(4|8|[0-9]*([02468][048]|[13579][26]))"


def cel(rule: str, message: str) -> dict[str, Any]:
    """A CEL rule, emitted into the CRD's ``x-kubernetes-validations``."""
    return {"rule": rule, "message": message}


def quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def string_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(quote(i) for i in items) + "]"


def opt(root: str, path: Sequence[str], default: str) -> str:
    """``root.a.b.c`` if every step is set, else ``default`` (a CEL literal)."""
    guards = " && ".join(f"has({root}.{'.'.join(path[: i + 1])})" for i in range(len(path)))
    return f"({guards} ? {root}.{'.'.join(path)} : {default})"


def chips(topology: str) -> str:
    """Chips of an ``AxB`` or ``AxBxC`` topology expression."""
    side = [f"int({topology}.split('x')[{i}])" for i in range(3)]
    return f"({topology}.split('x').size() == 3 ? {side[0]} * {side[1]} * {side[2]} : {side[0]} * {side[1]})"


def hosts(accelerator: str, topology: str) -> str:
    """Learner pods per slice (stoker.tpu.hosts_per_slice) of a valid TPU accelerator/topology pair."""
    two_d = [name for name, info in ACCELERATORS.items() if info.dims == 2]
    return (
        f"({accelerator} in {string_list(two_d)} ? ({chips(topology)} <= {SINGLE_HOST_MAX_CHIPS_2D} ? 1 : "
        f"{chips(topology)} / {CHIPS_PER_HOST_2D_MULTI}) : {chips(topology)} / {CHIPS_PER_HOST_3D})"
    )


def valid_topology(accelerator: str, topology: str) -> str:
    """stoker.tpu.slice_shape's rules: a fixed list in 2-D; small shapes or multiples of 4 in 3-D."""
    clauses = []
    for name, info in ACCELERATORS.items():
        if info.dims == 2:
            clauses.append(f"({accelerator} == {quote(name)} && {topology} in {string_list(info.topologies)})")
        else:
            shape = f"{topology}.matches('^{MULTIPLE_OF_4}x{MULTIPLE_OF_4}x{MULTIPLE_OF_4}$')"
            clauses.append(
                f"({accelerator} == {quote(name)} && ({topology} in {string_list(SMALL_3D)} || {shape})"
                f" && {chips(topology)} <= {info.max_chips})"
            )
    return "(" + " || ".join(clauses) + ")"


def name_fits(name: str, num_slices: str, hosts_per_slice: str) -> str:
    """stoker.jobname.max_name_length, with the digits of the last slice and host index."""
    return (
        f"{name}.size() <= {DNS_LABEL_MAX - FIXED_OVERHEAD}"
        f" - string({num_slices} - 1).size() - string({hosts_per_slice} - 1).size()"
    )


def rollout_name_fits(name: str, max_replicas: str, hosts_per_server: str) -> str:
    """stoker.jobname.max_rollout_name_length, with the digits of the last server and host index."""
    return (
        f"{name}.size() <= {DNS_LABEL_MAX - ROLLOUT_FIXED_OVERHEAD}"
        f" - string({max_replicas} - 1).size() - string({hosts_per_server} - 1).size()"
    )


def strictly_ascending(items: str, max_items: int) -> str:
    """CEL has no index loop: compare neighbours up to the list's maxItems."""
    return " && ".join(f"({items}.size() <= {i + 1} || {items}[{i}] < {items}[{i + 1}])" for i in range(max_items - 1))
