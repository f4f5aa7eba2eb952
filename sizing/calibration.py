"""What a chip really reaches, from `stoker bench` runs on it: the plan's estimates beside its bounds.

A bound takes every unit at its published peak; a compiled program reaches a share of it that
depends on what limits it. For a generation measured with ``stoker bench`` (benchmarks/README.md,
"TPU v5e, measured"), each program's measured time against its plan bound gives that share: the
compute share from the programs the compute term bounds (grad steps, prefill), the HBM share from
those the bytes bound (apply, publish, decode). An estimate is the bound's terms each divided by
its share, the largest of them. The measurements stay here with their dates, so the shares are
derived, never typed in, and every measurement is checked against its estimate
(tests/sizing/test_calibration.py: within 25 %). ``benchmarks/bench_table.py --calibration`` turns
a chip's ``stoker bench --json`` output into the lines to add.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stoker.sizing.bound import Bound


@dataclass(frozen=True)
class Measured:
    """One program's median on the chip (``stoker bench``) and the plan's bound for it then."""

    manifest: str
    program: str
    limit: str  # what bounds it in the plan: "compute" or "HBM"
    seconds: float
    bound_seconds: float
    date: str


@dataclass(frozen=True)
class Calibration:
    generation: str
    measured: tuple[Measured, ...]

    def share(self, limit: str) -> float | None:
        """The geometric mean of bound / measured over the programs ``limit`` bounds (None: none)."""
        ratios = [m.bound_seconds / m.seconds for m in self.measured if m.limit == limit]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None

    def estimate(self, bound: Bound) -> float:
        """The least of a program's bound terms each divided by this chip's share for it, the
        largest of them; a term no measurement calibrates (ICI, DCN) stays at its bound."""
        compute, hbm = self.share("compute") or 1.0, self.share("HBM") or 1.0
        return max(bound.compute_seconds / compute, bound.memory_seconds / hbm, bound.ici_seconds, bound.dcn_seconds or 0.0)


# Qwen2.5-0.5B shape, one chip, JAX 0.10.2 (benchmarks/chip/*.yaml, chip.sh bench).
V5E = Calibration("v5e", (
    Measured("q05-2k", "grad 4 x 2048 (remat full)", "compute", 0.3464, 0.1342, "2026-12-06"),
    Measured("q05-2k", "apply", "HBM", 0.0387, 0.0407, "2026-12-06"),
    Measured("q05-2k", "publish", "HBM", 0.0100, 0.0089, "2026-12-06"),
    Measured("q05-roll-b128", "prefill 128 x 2048", "compute", 4.812, 1.432, "2026-12-06"),
    # The plan's one-chip decode is the decode kernels' step since 2026-12-07; timed by
    # benchmarks/decode_step.py (128 x 2,048, full: the same program) until `stoker bench` reruns it.
    Measured("q05-roll-b128", "decode 128 rows, 2048 slots (decode kernels)", "HBM", 0.00608, 0.00445, "2026-12-07"),
))

CALIBRATIONS: dict[str, Calibration] = {c.generation: c for c in (V5E,)}


def calibration(generation: str) -> Calibration | None:
    """The generation's measurements, or None where no chip of it has been measured."""
    return CALIBRATIONS.get(generation)
