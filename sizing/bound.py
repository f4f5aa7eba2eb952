"""A speed bound per compiled program: the least time the chip's published peaks allow.

Roofline: a program cannot run faster than its flops at peak bf16 compute, nor than its bytes
accessed at peak HBM bandwidth, nor than its collectives' bytes at the published ICI (within a
slice) or DCN (across slices) bandwidth. The bound is the largest of those times; overlap is
assumed perfect and every unit busy, so a real step is slower. A bound, never a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoker.sizing.chips import Chip

if TYPE_CHECKING:  # programs.py builds the programs with JAX; a bound only reads their figures
    from stoker.sizing.programs import Program


@dataclass(frozen=True)
class Bound:
    compute_seconds: float
    memory_seconds: float
    ici_seconds: float
    dcn_seconds: float | None  # None: collectives cross slices but no DCN figure is published

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds, self.ici_seconds, self.dcn_seconds or 0.0)

    @property
    def limit(self) -> str:
        times = {"compute": self.compute_seconds, "HBM": self.memory_seconds, "ICI": self.ici_seconds,
                 "DCN": self.dcn_seconds or 0.0}
        return max(times, key=lambda k: times[k])


def program_bound(program: Program, chip: Chip, devices_per_chip: int = 1, devices: int = 1) -> Bound:
    """The bound of one run of ``program`` on one of its ``devices`` (a chip's share:
    1/devices_per_chip). libtpu's cost analysis counts a loop body once (blockwise attention's
    query blocks, the chunked log-probs), so the flops are at least the useful ones' share."""
    c = program.compiled
    flops = max(c.flops, program.model_flops / devices)
    share = 1.0 / devices_per_chip
    ici = c.collective_bytes.get("ici", 0.0) / (chip.ici_bytes_per_second * share) if chip.ici_bytes_per_second else 0.0
    dcn_bytes = c.collective_bytes.get("dcn", 0.0)
    dcn: float | None = 0.0
    if dcn_bytes:
        dcn = dcn_bytes / (chip.dcn_bytes_per_second * share) if chip.dcn_bytes_per_second else None
    return Bound(
        compute_seconds=flops / (chip.peak_bf16_flops * share),
        memory_seconds=c.bytes_accessed / (chip.hbm_bytes_per_second * share),
        ici_seconds=ici,
        dcn_seconds=dcn,
    )


@dataclass(frozen=True)
class StepBound:
    """The learner's step at full-length episodes: ``micro_batches`` grads of the longest bucket
    (each episode a full row), one apply, and the publish every ``publish_interval`` steps."""

    micro_batches: int
    seconds: float
    mfu: float  # useful flops / (seconds x every device's peak): an upper bound


def step_bound(grad: Program, apply: Program, publish: Program, *, episodes: int, rows: int, publish_interval: int,
               chip: Chip, devices: int, devices_per_chip: int = 1) -> StepBound:
    micro = max(1, math.ceil(episodes / rows))
    seconds = (micro * program_bound(grad, chip, devices_per_chip, devices).seconds
               + program_bound(apply, chip, devices_per_chip, devices).seconds
               + program_bound(publish, chip, devices_per_chip, devices).seconds / publish_interval)
    peak = chip.peak_bf16_flops * devices / devices_per_chip
    mfu = micro * grad.model_flops / (seconds * peak) if seconds > 0 else 0.0
    return StepBound(micro, seconds, mfu)


def decode_tokens_per_second(decode: Program, chip: Chip, devices_per_chip: int = 1, devices: int = 1) -> float:
    """Tokens/s one server can at most sample: a decode step gives every row one token."""
    seconds = program_bound(decode, chip, devices_per_chip, devices).seconds
    return decode.tokens / seconds if seconds > 0 else math.inf


def decode_attainable_seconds(decode: Program, chip: Chip, devices_per_chip: int = 1, devices: int = 1) -> float:
    """The least time any decode step of ``decode``'s shapes can take: reading only what it must,
    the weights once and each row's cached context (its "parameters" and "batch KV" terms, per
    device) at peak HBM bandwidth, or its useful flops at peak compute, whichever is longer.

    ``program_bound`` takes the compiler's bytes accessed, what this program does read however
    wastefully; this is the roofline a sampler is judged against (issue 52's "attainable")."""
    share = 1.0 / devices_per_chip
    must_read = decode.terms.get("parameters", 0) + decode.terms.get("batch KV", 0)
    memory = must_read / (chip.hbm_bytes_per_second * share)
    compute = decode.model_flops / devices / (chip.peak_bf16_flops * share)
    return max(memory, compute)
