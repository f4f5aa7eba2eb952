"""Shared fixtures for the shipping tests: the chart, loaded once through the real Helm SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
import pytest

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "stoker"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def chart_dir() -> Path:
    return CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
