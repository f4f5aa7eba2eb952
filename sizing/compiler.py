"""The real TPU compiler on a host without a TPU: abstract devices of a named slice, ahead-of-time
compilation, and what the compiled program says about itself.

``jax.experimental.topologies.get_topology_desc`` gives the devices of a slice from libtpu alone;
``jax.jit(...).lower(ShapeDtypeStructs).compile()`` over a mesh of them runs libtpu's compiler,
whose ``memory_analysis()`` and ``cost_analysis()`` describe the TPU program (never the CPU's: the
CPU backend's temporaries for the same step are more than twice the TPU's). Collectives are read
from the compiled HLO text, since the cost analysis does not count the bytes they move.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

INSTALL_HINT = "the TPU compiler (libtpu) is not installed: pip install 'stoker[tpu]'"


class CompilerMissing(RuntimeError):
    """libtpu is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Slice:
    """The abstract devices of ``num_slices`` slices named ``name`` (libtpu's spelling, v5e:2x2)."""

    name: str
    devices: tuple[Any, ...]
    num_slices: int
    chips: int  # per slice

    @property
    def devices_per_chip(self) -> int:
        return max(1, len(self.devices) // (self.chips * self.num_slices))


def load_slice(name: str, chips: int, num_slices: int = 1) -> Slice:
    """The devices libtpu describes for ``name``; ``CompilerMissing`` without libtpu."""
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # quiets libtpu's start-up complaint
    # libtpu takes /tmp/libtpu_lockfile when it loads, so a second process (another plan, a test
    # run beside it) would fail; compiling opens no device, so several may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise CompilerMissing(INSTALL_HINT) from None
    # JAX once libtpu is found: `stoker plan` imports this module before it parses its flags.
    from jax.experimental import topologies

    options: dict[str, Any] = {"num_slices": num_slices} if num_slices > 1 else {}
    if chips == 1:  # libtpu's default host is 2x2 chips; a one-chip slice is a one-chip host
        options["chips_per_host_bounds"] = (1, 1, 1)
    topology = topologies.get_topology_desc(platform="tpu", topology_name=name, **options)
    return Slice(name, tuple(topology.devices), num_slices, chips)


@dataclass
class Compiled:
    """Per device, from one compiled program."""

    seconds: float
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    flops: float = 0.0
    bytes_accessed: float = 0.0
    # Bytes each device sends or receives, by link: "ici" within a slice, "dcn" across slices.
    collective_bytes: dict[str, float] = field(default_factory=lambda: {"ici": 0.0, "dcn": 0.0})
    collectives: int = 0
    # The compiler's own refusal (out of HBM), when it refused.
    error: str | None = None
    required_temp_bytes: int | None = None  # from the refusal's message
    # The runnable program, kept only when asked (``stoker bench`` runs what it compiled for real
    # devices; a plan's programs for abstract devices cannot run).
    executable: Any = None


# "Ran out of memory in memory space hbm ... HLO temporaries (57.07G) exceeds available HBM (31.25G)"
_OOM_TEMPS = re.compile(r"temporaries \((\d+(?:\.\d+)?)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_program(jitted: Any, args: Sequence[Any], devices: Sequence[Any], slice_of: Callable[[int], int],
                    *, keep: bool = False) -> Compiled:
    """Lower ``jitted`` on abstract ``args`` and compile it; a refusal for memory is returned as
    ``Compiled.error``, any other compiler error raised. ``devices`` are the program's, in mesh
    order (the ids its collectives name); ``slice_of(id)`` is a device's slice. ``keep``: hold the
    compiled program in ``Compiled.executable``."""
    started = time.perf_counter()
    return compile_lowered(jitted.lower(*args), started, devices, slice_of, keep=keep)


def compile_lowered(lowered: Any, started: float, devices: Sequence[Any], slice_of: Callable[[int], int],
                    *, keep: bool = False) -> Compiled:
    """``compile_program`` after its lowering (traced on the calling thread, ``started`` when that
    began): the compile alone is XLA's, without the interpreter lock, so several can run side by
    side on threads."""
    try:
        compiled = lowered.compile()
    except Exception as exc:  # jax raises XlaRuntimeError / JaxRuntimeError; both carry the text
        from stoker.learner.remat import refused_for_memory  # JAX's side: not loaded with this module

        if not refused_for_memory(exc):
            raise
        text = str(exc)
        match = _OOM_TEMPS.search(text)
        required = int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None
        first = next((line for line in text.splitlines() if "memory" in line.lower()), text.splitlines()[0])
        return Compiled(time.perf_counter() - started, error=first.strip()[:400], required_temp_bytes=required)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    out = Compiled(
        seconds=time.perf_counter() - started,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        executable=compiled if keep else None,
    )
    out.collective_bytes, out.collectives = collective_traffic(compiled.as_text(), len(devices), slice_of)
    return out


# One collective in HLO text: "%name = TYPE all-gather(...), ..., replica_groups=..."
_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\(?[^=]*?\)?)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\((?P<rest>.*)$"
)
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def _shapes_bytes(text: str) -> list[int]:
    return [math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype] for dtype, dims in _SHAPE.findall(text)]


def _groups(rest: str, devices: int) -> list[list[int]]:
    mesh = _MESH_GROUPS.search(rest)
    if mesh:  # replica_groups=mesh['axis_0'=16,'axis_1'=4] {'axis_0'}: devices varying along the named axes
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        chosen = re.findall(r"'([^']+)'", mesh.group(2))
        names = [name for name, _ in axes]
        ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
        order = [names.index(n) for n in names if n not in chosen] + [names.index(n) for n in chosen]
        size = math.prod(size for name, size in axes if name in chosen)
        return [list(map(int, row)) for row in ids.transpose(order).reshape(-1, max(size, 1))]
    iota = _IOTA_GROUPS.search(rest)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
        return [list(map(int, row)) for row in ids.reshape(count, size)]
    listed = _LIST_GROUPS.search(rest)
    if listed:
        groups = [[int(x) for x in g.strip("{}").split(",") if x] for g in re.findall(r"\{[\d,]*\}", listed.group(1))]
        if groups and groups[0]:
            return groups
    return [list(range(devices))]  # no groups named: every device


def collective_traffic(hlo: str, devices: int, slice_of: Callable[[int], int]) -> tuple[dict[str, float], int]:
    """Bytes one device moves for the program's collectives, by link, counting each op once (a
    collective inside a loop body is counted once, not per iteration). Ring algorithms: an
    all-gather or all-to-all of N result bytes over a group of n moves N (n-1)/n; a reduce-scatter
    of a result shard N moves N (n-1); an all-reduce 2 N (n-1)/n; a permute N."""
    traffic = {"ici": 0.0, "dcn": 0.0}
    count = 0
    for line in hlo.splitlines():
        match = _COLLECTIVE.search(line)
        if not match or "-done" in match.group("op"):
            continue
        op, sizes = match.group("op"), _shapes_bytes(match.group("type"))
        if not sizes:
            continue
        # An async start's type is a tuple of (operands..., results...): its results are the larger half.
        result = max(sizes) if match.group("start") and op != "all-reduce" else sum(sizes)
        if match.group("start") and op == "all-reduce":
            result = sum(sizes) // 2 if len(sizes) > 1 else sum(sizes)
        rest = match.group("rest")
        if op == "collective-permute":
            listed = _PAIRS.search(rest)
            pairs = re.findall(r"\{(\d+),(\d+)\}", listed.group(1)) if listed else []
            crosses = any(slice_of(int(a)) != slice_of(int(b)) for a, b in pairs)
            moved, link = float(result), "dcn" if crosses else "ici"
        else:
            group = _groups(rest, devices)[0]
            n = len(group)
            if n <= 1:
                continue
            factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n, "reduce-scatter": n - 1,
                      "all-reduce": 2 * (n - 1) / n}[op]
            moved = result * factor
            link = "dcn" if len({slice_of(i) for i in group}) > 1 else "ici"
        traffic[link] += moved
        count += 1
    return traffic, count
