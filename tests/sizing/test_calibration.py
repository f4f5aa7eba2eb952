"""The plan's estimates: its bounds at the share of each peak a chip generation reached when measured."""

from __future__ import annotations

import math

import pytest

from stoker.sizing.bound import Bound
from stoker.sizing.calibration import V5E, Calibration, Measured, calibration


def test_every_measurement_is_within_a_quarter_of_its_estimate() -> None:
    """Issue 51's goal for the plan: within 25 % of `stoker bench` on every manifest measured."""
    for m in V5E.measured:
        bound = Bound(
            compute_seconds=m.bound_seconds if m.limit == "compute" else 0.0,
            memory_seconds=m.bound_seconds if m.limit == "HBM" else 0.0,
            ici_seconds=0.0, dcn_seconds=0.0,
        )
        assert V5E.estimate(bound) == pytest.approx(m.seconds, rel=0.25), m


def test_the_shares_are_derived_from_the_measurements_and_uncalibrated_terms_stay_bounds() -> None:
    chip = Calibration("test", (
        Measured("a", "grad", "compute", 4.0, 1.0, "d"),  # 25 % of peak
        Measured("b", "prefill", "compute", 2.5, 1.6, "d"),  # 64 %
        Measured("c", "apply", "HBM", 1.0, 0.8, "d"),
    ))
    assert chip.share("compute") == pytest.approx(0.4)  # the geometric mean of 0.25 and 0.64
    assert chip.share("HBM") == pytest.approx(0.8) and chip.share("ICI") is None
    assert chip.estimate(Bound(1.0, 0.4, 0.0, None)) == pytest.approx(2.5)  # compute at 40 %
    assert chip.estimate(Bound(0.1, 0.4, 0.0, None)) == pytest.approx(0.5)  # HBM at 80 %
    assert chip.estimate(Bound(1.0, 0.4, 3.0, None)) == 3.0  # no measurement of ICI: its bound
    assert 0.25 < V5E.share("compute") < 0.45 and 0.8 < V5E.share("HBM") < 1.1  # type: ignore[operator]


def test_only_a_measured_generation_gets_estimates() -> None:
    assert calibration("v5e") is V5E
    assert calibration("v5p") is None and calibration("v6e") is None
    assert all(m.seconds > m.bound_seconds * 0.8 and math.isfinite(m.seconds) for m in V5E.measured)
