"""One markdown table from several ``stoker bench --json`` outputs (benchmarks/chip.sh's bench part).

    .venv/bin/python benchmarks/bench_table.py runs/chip/bench-*.json > bench.md
    .venv/bin/python benchmarks/bench_table.py --calibration runs/chip/bench-*.json   # rows for sizing/calibration.py

A row per program: its manifest, status, median seconds, tokens/s, MFU, peak memory, the plan's
bound and, for a decode step, the share of the attainable rate. A file that is not a bench's JSON
(the bench was killed, or refused its manifest) is a row saying so. ``--calibration`` prints
instead, for each program that ran and whose bound is its compute or HBM term, the ``Measured``
line that ``sizing/calibration.py`` keeps for the chip.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

HEADER = ("manifest", "program", "shape", "status", "median", "tokens/s", "MFU", "peak GiB", "plan bound",
          "of attainable", "first step")


def _cell(value: Any, form: str) -> str:
    return "-" if value is None else format(value, form)


def rows_of(path: Path) -> list[tuple[str, ...]]:
    name = path.stem.removeprefix("bench-")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return [(name, "-", "-", "no report (killed, or refused: see its log)", *["-"] * (len(HEADER) - 4))]
    first = _cell(result.get("first_step_seconds"), ".1f")
    out = []
    for r in result["programs"]:
        bound = (r["plan"].get("bound") or {}).get("seconds")
        peak = r.get("peak_bytes_per_device")
        out.append((
            name, f"{r['component']} {r['program']}", r["shape"], r["status"] + (f": {r['reason']}" if r["reason"] else ""),
            _cell(r["seconds"] and r["seconds"] * 1e3, ".1f") + (" ms" if r["seconds"] else ""),
            _cell(r["tokens_per_second"], ",.0f"), _cell(r["mfu"] and 100 * r["mfu"], ".1f") + ("%" if r["mfu"] else ""),
            _cell(peak and peak / 2**30, ".2f"), _cell(bound and bound * 1e3, ".1f") + (" ms" if bound else ""),
            _cell(r.get("share_of_attainable") and 100 * r["share_of_attainable"], ".0f")
            + ("%" if r.get("share_of_attainable") else ""),
            first + (" s" if first != "-" else ""),
        ))
    return out


def table(paths: list[Path]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for path in paths:
        lines += ["| " + " | ".join(row) + " |" for row in rows_of(path)]
    return "\n".join(lines)


def calibration_lines(paths: list[Path]) -> list[str]:
    today = datetime.date.today().isoformat()
    lines = []
    for path in paths:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for r in result["programs"]:
            bound = r["plan"].get("bound") or {}
            if r["status"] != "ran" or not r["seconds"] or bound.get("limit") not in ("compute", "HBM"):
                continue
            lines.append(f'    Measured("{path.stem.removeprefix("bench-")}", "{r["program"]} {r["shape"]}", '
                         f'"{bound["limit"]}", {r["seconds"]:.4g}, {bound["seconds"]:.4g}, "{today}"),')
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--calibration"]:
        print("\n".join(calibration_lines([Path(p) for p in sys.argv[2:]])))
    else:
        print(table([Path(p) for p in sys.argv[1:]]))
