"""JSON Lines records as Stoker writes them (``learner_metrics.jsonl``, ``buffer_stats.jsonl``).

Every line is strict JSON, so jq, JavaScript and Go read it: a non-finite float (a NaN gradient
norm, a mean over no tokens) is written as ``null``, never as Python's bare ``NaN``/``Infinity``.
Readers take ``null`` as "no value this step".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN or infinity, in dicts and lists too, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def json_line(record: dict[str, Any], *, sort_keys: bool = False) -> str:
    """One record as a line of strict JSON (non-finite floats as null), newline included."""
    return json.dumps(finite_or_null(record), sort_keys=sort_keys, allow_nan=False) + "\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole record of ``path`` (none if it does not exist)."""
    records: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from an interrupted writer
    return records
