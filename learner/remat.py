"""``model.remat: auto``: the cheapest rematerialisation policy whose learner step fits the device.

Remat trades compute for memory: ``none`` keeps every activation for the backward pass,
``save-matmuls`` recomputes all but the matmul outputs, ``full`` keeps only each layer's input and
recomputes the rest (~a third more layer compute; on a v5e, Qwen2.5-0.5B GRPO at 4 x 2,048 tokens
ran at 38.8 % MFU under full against 46.2 % under none, which fit in 9.6-10.3 GiB of 15.75). So auto
tries them in that order and keeps the first whose step, as the compiler lays it out for the job's
real shapes, leaves ``HEADROOM`` of the device's memory free.

The same rule serves ``stoker plan`` (libtpu's memory analysis for the manifest's slice, no TPU
needed; ``stoker.sizing.programs``) and the learner on its own accelerator (that chip's compiled
memory analysis against its runtime's ``bytes_limit``: ``learner_remat``). On the CPU auto is
``none`` without compiling anything: host memory is not the constraint remat exists for, and
tests and local runs must not pay extra compiles at every start.

A step's bytes per device are counted term by term (``grad_terms``): the state that lives beside
it (parameters, Adam state, the gradient sum, the last publish's copy), its arguments and the
compiler's temporaries.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from stoker.actor_count import host_cores
from stoker.learner import train, trees
from stoker.model.model import RematPolicy
from stoker.spec_model import RematSetting

log = logging.getLogger(__name__)

# Cheapest in compute first: auto takes the first that fits.
REMAT_ORDER: tuple[RematPolicy, ...] = ("none", "save-matmuls", "full")
# The share of the device's memory auto leaves free. The compiler's figure is the program's own;
# beside it sit the runtime's buffers, fragmentation and whatever the host code keeps alive (the
# batch prefetched while a step runs), which it does not count. The plan has no headroom setting
# of its own; 10 % of a v5e is 1.6 GiB.
HEADROOM = 0.10
GIB = 2**30


@dataclass(frozen=True)
class RematChoice:
    """The policy the step compiles with, and why (said at start)."""

    setting: RematSetting
    policy: RematPolicy
    reason: str
    # auto's step bytes per device for each policy it compiled (None: the compiler refused it).
    peaks: Mapping[RematPolicy, int | None] = field(default_factory=dict)

    @property
    def line(self) -> str:
        """E.g. ``remat auto: none (peak 10.30 GiB of 15.75 GiB, headroom 10%)``."""
        return f"remat {self.setting}: {self.policy} ({self.reason})"


def budget(limit_bytes: int, headroom: float = HEADROOM) -> int:
    """The bytes a step may take on a device of ``limit_bytes``, leaving ``headroom`` free."""
    return int(limit_bytes * (1.0 - headroom))


def choose_remat(peak: Callable[[RematPolicy], int | None], limit_bytes: int,
                 headroom: float = HEADROOM) -> RematChoice:
    """The first of ``REMAT_ORDER`` whose ``peak`` (bytes per device; None: the compiler refused
    it) is within ``budget(limit_bytes, headroom)``. ``peak`` is called only until one fits, as
    each call compiles. When none fits: the one that needs the least (full when the compiler
    refused them all), and the reason says so."""
    allowed = budget(limit_bytes, headroom)
    peaks: dict[RematPolicy, int | None] = {}
    for policy in REMAT_ORDER:
        peaks[policy] = peak(policy)
        needed = peaks[policy]
        if needed is not None and needed <= allowed:
            return RematChoice("auto", policy, f"peak {size(needed)} of {size(limit_bytes)}, headroom {headroom:.0%}",
                               peaks)
    tried = ", ".join(f"{p} {'refused by the compiler' if b is None else size(b)}" for p, b in peaks.items())
    # The compiler's layouts do not always order the policies' memory as their names suggest.
    known = {p: b for p, b in peaks.items() if b is not None}
    least = min(known, key=lambda p: (known[p], p != "full")) if known else "full"
    return RematChoice("auto", least, f"nothing fits {size(allowed)} ({size(limit_bytes)} less headroom "
                                      f"{headroom:.0%}): {tried}; {least} needs the least", peaks)


def size(n: int) -> str:
    """Bytes as GiB, or MiB under one GiB (a small model's step)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def resolve_remat(setting: RematSetting, platform: str, peak: Callable[[RematPolicy], int | None],
                  limit_bytes: int | None, headroom: float = HEADROOM) -> RematChoice:
    """``setting`` (spec.model.remat) for a device of ``platform`` (jax's: cpu, tpu, gpu) holding
    ``limit_bytes`` (None: not known); ``peak`` as ``choose_remat``'s, called only for auto on an
    accelerator."""
    if setting != "auto":
        return RematChoice(setting, setting, "model.remat")
    if platform == "cpu":
        return RematChoice("auto", "none", "on the CPU: host memory, nothing compiled to decide")
    if limit_bytes is None:
        return RematChoice("auto", "full", f"the {platform} runtime gives no memory limit: the least memory")
    return choose_remat(peak, limit_bytes, headroom)


# ------------------------------------------------------------------------- a step's bytes


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of an abstract tree whose leaves carry their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


@dataclass(frozen=True)
class StateBytes:
    """Per device: what lives beside every learner program (``train.Trainer``'s trees)."""

    params: int
    opt_state: int
    reference: int
    published: int  # the last publish's copy in the compute dtype, read while training goes on

    @classmethod
    def of(cls, trainer: train.Trainer) -> StateBytes:
        policy = trainer.params.get("policy")
        return cls(
            params=shard_bytes(trainer.params), opt_state=shard_bytes(trainer.opt_state),
            reference=shard_bytes(trainer.reference) if trainer.reference is not None else 0,
            published=shard_bytes(trees.cast_floats(policy, trainer.compute_dtype)) if policy is not None else 0,
        )


def grad_terms(state: StateBytes, argument_bytes: int, temp_bytes: int) -> dict[str, int]:
    """A grad step's bytes per device, term by term, from its compiled arguments and temporaries."""
    terms = {"parameters": state.params, "optimizer": state.opt_state}
    if state.reference:
        terms["reference"] = state.reference
    # The sum of the micro-batches so far beside this one's gradients (train.Trainer.step).
    terms["gradients"] = 2 * state.params
    if state.published:
        terms["publish copy"] = state.published
    terms["batch"] = max(0, argument_bytes - state.params - state.reference)
    terms["temporaries"] = temp_bytes
    return terms


def refused_for_memory(exc: Exception) -> bool:
    """Whether a compile failed because the program does not fit (libtpu's RESOURCE_EXHAUSTED)."""
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "memory" in text.lower()


# ------------------------------------------------------------------ the learner on its device


def abstract(module: Any) -> Any:
    """``module`` with shapes and dtypes in place of its arrays: a trainer built on it compiles
    and allocates nothing (``train.Trainer``'s abstract mode). None stays None."""
    if module is None:
        return None
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))


SIDE_BY_SIDE_MIN_CORES = 4  # a core per compile, about: fewer and they would only queue


def side_by_side_workers(cores: int | None = None) -> int:
    """Threads for compiling auto's candidates side by side: one per candidate and one for the
    apply on a host with the cores for it (a TPU VM); none on a small one (CI's two cores), where
    the candidates compile in turn and stop at the first that fits."""
    cores = host_cores() if cores is None else cores
    return 0 if cores < SIDE_BY_SIDE_MIN_CORES else min(cores, len(REMAT_ORDER) + 1)


def step_peak(trainer: train.Trainer, rows: Mapping[int, int], allowed: int,
              longest: Future[Any] | None = None) -> int | None:
    """The largest grad step's bytes per device over the buckets (length -> rows), compiled for
    ``trainer``'s devices, longest first; stops at the first over ``allowed``. None when the
    compiler refuses one for memory. ``longest``: the longest bucket's compile, already under way."""
    state = StateBytes.of(trainer)
    peak = 0
    for length in sorted(rows, reverse=True):
        try:
            if longest is not None:
                compiled, longest = longest.result(), None
            else:
                grad, args = trainer.programs(rows[length], length)["grad"]
                compiled = grad.lower(*args).compile()
            memory = compiled.memory_analysis()
        except Exception as exc:  # jax's XlaRuntimeError; anything but a refusal for memory is a bug
            if not refused_for_memory(exc):
                raise
            return None
        peak = max(peak, sum(grad_terms(state, int(memory.argument_size_in_bytes),
                                        int(memory.temp_size_in_bytes)).values()))
        if peak > allowed:
            break
    return peak


def timed_compile(policy: RematPolicy, lowered: Any) -> Any:
    """``lowered.compile()``, its seconds logged: a large step's compile takes minutes on a TPU host."""
    started = time.perf_counter()
    try:
        return lowered.compile()
    finally:
        log.info("remat auto: %s compiled in %.1f s", policy, time.perf_counter() - started)


def device_limit(device: Any) -> int | None:
    """The bytes the runtime lets one program hold on ``device`` (None where it keeps no count)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def learner_remat(setting: RematSetting, mesh: Any, rows: Mapping[int, int],
                  build: Callable[[RematPolicy], train.Trainer], headroom: float = HEADROOM,
                  workers: int | None = None) -> RematChoice:
    """``setting`` resolved on ``mesh``'s devices: for auto on an accelerator, each policy's grad
    step compiled for every bucket by an abstract trainer from ``build(policy)`` (nothing
    allocated) and judged against the device's ``bytes_limit``. With ``workers`` threads (None:
    ``side_by_side_workers()``) every policy's longest bucket compiles at once, traced here and
    compiled on the threads: on a v5e host each compile of a 0.5B step takes 20-50 s, and in turn
    auto cost that run's learner 75 s before its first step (benchmarks/README.md)."""
    device = mesh.devices.flat[0]
    limit = device_limit(device) if setting == "auto" and device.platform != "cpu" else None
    allowed = budget(limit, headroom) if limit is not None else 0
    workers = side_by_side_workers() if workers is None else workers
    if limit is None or workers < 2:
        return resolve_remat(setting, device.platform, lambda policy: step_peak(build(policy), rows, allowed),
                             limit, headroom)
    longest = max(rows)
    trainers = {policy: build(policy) for policy in REMAT_ORDER}
    log.info("remat auto: compiling the %d-token step under %s side by side to find the cheapest within %s",
             longest, ", ".join(REMAT_ORDER), size(allowed))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remat")
    try:
        futures = {}
        for policy, trainer in trainers.items():
            grad, args = trainer.programs(rows[longest], longest)["grad"]
            futures[policy] = pool.submit(timed_compile, policy, grad.lower(*args))
        return resolve_remat(setting, device.platform,
                             lambda policy: step_peak(trainers[policy], rows, allowed, futures[policy]),
                             limit, headroom)
    finally:  # a candidate auto did not need is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
