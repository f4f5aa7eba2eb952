"""``stoker bench``'s table: each program's measured figures beside the plan's."""

from __future__ import annotations

from typing import Any

from stoker.sizing.chips import GIB
from stoker.sizing.plan import gib


def _time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def render(result: dict[str, Any]) -> str:
    h = result["host"]
    peak = f"peak {h['peak_flops_per_device'] / 1e12:.0f} TFLOP/s each" if h["chip"] else "peak flops unknown: MFU n/a"
    lines = [f"{h['devices']} {h['device_kind']} device(s) ({peak}; {gib(h['memory_limit_bytes_per_device'])} GiB each, "
             f"{h['memory_limit_source']}); median of {result['repeats']} runs after a warm-up"]
    rows = result["programs"]
    unit, scale = ("GiB", GIB) if any(r["plan"]["total_bytes"] >= GIB for r in rows) else ("MiB", 2**20)
    header = ["program", "shape", "compile", "1st run", "median", "tokens/s", "MFU", f"peak {unit}", f"plan {unit}",
              "plan bound"]
    table = [header]
    for r in rows:
        bound = r["plan"]["bound"]
        cells = [f"{r['component']} {r['program']}", r["shape"], _time(r["compile_seconds"])]
        if r["status"] == "ran":
            cells += [_time(r["first_run_seconds"]), _time(r["seconds"]),
                      f"{r['tokens_per_second']:,.0f}" if r["tokens_per_second"] else "-",
                      f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a",
                      f"{r['peak_bytes_per_device'] / scale:.2f}" if r["peak_bytes_per_device"] is not None else "n/a"]
        else:
            cells += [r["status"].upper(), "", "", "", ""]
        cells += [f"{r['plan']['total_bytes'] / scale:.2f}",
                  f">= {_time(bound['seconds'])} ({bound['limit']}-bound)" if bound else "n/a"]
        if bound and bound.get("estimate_seconds"):
            cells[-1] += f", ~{_time(bound['estimate_seconds'])} as measured"
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:  # names and shapes to the left, figures to the right
        lines.append("  " + "  ".join(cell.ljust(w) if i in (0, 1, 9) else cell.rjust(w)
                                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    lines.append(f"  (memory per device; compile: trace and compile, cold unless a cache held it; plan: the terms "
                 "`stoker plan` counts for these devices; ~: its estimate where this chip generation has been "
                 "measured, sizing/calibration.py)")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    for r in rows:
        if r["status"] != "ran":
            lines.append(f"{r['status'].upper()}: {r['component']} {r['program']}: {r['reason']}")
    for r in rows:
        if r.get("attainable_tokens_per_second"):
            lines.append(f"{r['component']} {r['program']}: {r['tokens_per_second']:,.0f} tokens/s, "
                         f"{r['share_of_attainable']:.0%} of the attainable {r['attainable_tokens_per_second']:,.0f} "
                         "(the weights once and each row's cached context at peak HBM bandwidth, or its flops at peak)")
    lines += [f"NOT BUILT on these devices: {why}" for why in result["not_built"]]
    if result.get("first_step_seconds") is not None:
        lines.append(f"time to a learner's first step: {_time(result['first_step_seconds'])} (its first grad and the "
                     "apply, each compiled and run once)")
    return "\n".join(lines)
