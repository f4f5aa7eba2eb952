"""Where a synchronous or colocated run's time goes: each step's wall time split into generating
(the sampler's calls), the rest of playing the batch's episodes (environments, tokenizing),
training, and handing the new weights to the sampler, with the tokens each phase processed
(``phases.jsonl``, a line a step) and, in the report, each phase's tokens/s and, on a chip with
published figures (``stoker.tpu_figures``), its MFU.

Useful flops (``stoker.model.flops``): generating 2 x the matmul parameters per token sampled or
prefilled, training 6 x per token of the batch per update; attention and recomputation are not
counted, so the MFU is a floor."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from stoker.jsonl import json_line, read_jsonl
from stoker.tpu_figures import chip_of_device

PHASES_FILE = "phases.jsonl"


@dataclasses.dataclass
class StepPhases:
    step: int
    wall_seconds: float  # the whole step
    generate_seconds: float  # in the sampler's calls (its compiles included)
    play_seconds: float  # playing the batch's episodes, generating included
    train_seconds: float
    weights_seconds: float
    sampled_tokens: float
    prefilled_tokens: float
    trained_tokens: float  # real tokens of the batch x updates per batch
    matmul_params: int
    device_kind: str
    devices: int
    compile_seconds: float = 0.0  # tracing, lowering and compiling programs (the process's, any of them)


# A step that spent more than this share of its wall time compiling (a sampler program for a shape
# the run had not met, say) is left out of the report's table, which is about the steady state.
COMPILING_SHARE = 0.1


def compiled(row: dict[str, Any]) -> bool:
    return float(row.get("compile_seconds", 0.0)) > COMPILING_SHARE * float(row["wall_seconds"])


def peak_flops(device_kind: str, devices: int) -> float | None:
    """The devices' published dense bf16 peak, or None where none is published (a CPU)."""
    chip = chip_of_device(device_kind)
    return chip.peak_bf16_flops * devices if chip is not None else None


def append(run_dir: Path, phases: StepPhases) -> None:
    with open(run_dir / PHASES_FILE, "a") as out:
        out.write(json_line(dataclasses.asdict(phases)))


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %" if whole > 0 else "-"


def _mfu(flops: float, seconds: float, peak: float | None) -> str:
    return f"{100 * flops / (seconds * peak):.1f} %" if peak and seconds > 0 else "-"


def report_lines(run_dir: Path) -> list[str]:
    """The report's section, from the steps after the first (which compiles every program) that
    did not compile."""
    rows = read_jsonl(run_dir / PHASES_FILE)
    steady: list[dict[str, Any]] = [r for r in rows[1:] if not compiled(r)]
    stalled = [r for r in rows[1:] if compiled(r)]
    if not steady:  # every step compiled (a short run): better those than no table
        steady, stalled = rows[1:], []
    if not steady:
        return []
    total = {key: sum(float(r[key]) for r in steady) for key in (
        "wall_seconds", "generate_seconds", "play_seconds", "train_seconds", "weights_seconds", "sampled_tokens",
        "prefilled_tokens", "trained_tokens")}
    last = steady[-1]
    params, peak = int(last["matmul_params"]), peak_flops(str(last["device_kind"]), int(last["devices"]))
    gen_s, train_s = total["generate_seconds"], total["train_seconds"]
    rest_s = total["play_seconds"] - gen_s
    generated = total["sampled_tokens"] + total["prefilled_tokens"]
    wall = total["wall_seconds"]
    where = f"{last['devices']} {last['device_kind']} device(s)" + ("" if peak else ", no published peak: no MFU")
    left_out = (f"; {len(stalled)} that compiled left out, {sum(float(r['wall_seconds']) for r in stalled):.1f} s"
                if stalled else "")
    return [
        f"## Where a step's time went ({len(steady)} steps after the first{left_out}; {where})",
        "",
        "| phase | share of the wall time | tokens/s | MFU (matmul flops) |",
        "|---|---|---|---|",
        f"| generating (the sampler's calls) | {_share(gen_s, wall)} | "
        f"{total['sampled_tokens'] / gen_s if gen_s else 0:,.0f} sampled, "
        f"{total['prefilled_tokens'] / gen_s if gen_s else 0:,.0f} prefilled | {_mfu(2 * params * generated, gen_s, peak)} |",
        f"| the rest of playing (environments, tokenizing) | {_share(rest_s, wall)} | - | - |",
        f"| training | {_share(train_s, wall)} | {total['trained_tokens'] / train_s if train_s else 0:,.0f} trained | "
        f"{_mfu(6 * params * total['trained_tokens'], train_s, peak)} |",
        f"| new weights to the sampler | {_share(total['weights_seconds'], wall)} | - | - |",
        "",
        f"A step took {wall / len(steady):.2f} s on average.",
        "",
    ]
