"""``stoker bench JOB.yaml``: run the job's device programs on this host's devices (a TPU slice's
host, or the CPU) and measure them beside what ``stoker plan`` says of the same programs.

The programs are ``stoker plan``'s, built by the same functions (``sizing/programs.py``,
``sizing/programs_rollout.py``) but compiled for ``jax.devices()`` instead of a remote topology,
and then run: random weights of the job's architecture, full-length batches at its sequence
buckets and micro-batch rows, a rollout server's longest prefill chunk and a decode step at
``rollout.maxBatch``. Per program: the cold compile, the first run, the median of ``--repeats``
timed runs, tokens/s, MFU from the plan's useful flops, and the devices' peak memory, beside the
plan's memory terms, its fit check and its speed bound for these devices. A program the plan's
check says cannot fit is not run: it is reported with its largest term and what would shrink it.

A program that has not finished within ``--program-timeout`` seconds is reported as unfinished,
with what it was doing, and nothing after it runs: a hang is reported, never waited on forever.

Exit status: 0 when every program ran, 1 when one does not fit (or ran out of memory), 2 for bad
input, 3 when one did not finish in its bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stoker.manifest import load_job
from stoker.sizing.bench_report import render
from stoker.sizing.bench_watch import Phase, Unfinished, bounded
from stoker.sizing.bound import decode_attainable_seconds, program_bound
from stoker.sizing.calibration import calibration
from stoker.sizing.chips import Chip, chip_of_device
from stoker.sizing.compiler import Slice
from stoker.sizing.plan import Target, advice, fits, gib
from stoker.spec import RLJobSpec

if TYPE_CHECKING:
    from stoker.sizing.programs import Program

LEARNER_KINDS = ("grad", "apply", "publish")
ROLLOUT_KINDS = ("prefill", "decode")
SEED = 0
PROGRAM_TIMEOUT_SECONDS = 300.0  # inputs, first run and repeats of one program: seconds on any accelerator
EXIT_UNFINISHED = 3
PEAK_NOTE = ("a program's peak is the devices' peak since the bench began (JAX cannot reset it): shown where it rose "
             "above the programs run before it (smallest plan first), n/a where it did not")


def program_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in LEARNER_KINDS + ROLLOUT_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'nothing'}: expected a comma-separated list of {', '.join(LEARNER_KINDS + ROLLOUT_KINDS)}")
    return kinds


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="RLJob manifest")
    parser.add_argument("--repeats", type=positive, default=5, metavar="N",
                        help="timed runs of each program after its warm-up run; the median is reported (default 5)")
    parser.add_argument("--programs", type=program_kinds, metavar="LIST",
                        help="only these programs, e.g. grad,apply or prefill,decode (default: all of "
                             f"{', '.join(LEARNER_KINDS + ROLLOUT_KINDS)})")
    parser.add_argument("--program-timeout", type=positive, default=int(PROGRAM_TIMEOUT_SECONDS), metavar="SECONDS",
                        help="a program whose inputs, first run and timed runs take longer is reported as unfinished "
                             f"and the bench stops there (default {int(PROGRAM_TIMEOUT_SECONDS)})")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (for CI)")


@dataclass(frozen=True)
class Host:
    """This host's devices, as the bench judges and times them."""

    slice_: Slice
    platform: str
    chip: Chip | None  # the published figures of the devices' TPU generation; None where unknown (the CPU)
    memory_limit: int  # bytes one device may hold
    memory_source: str  # where memory_limit comes from

    @property
    def devices(self) -> tuple[Any, ...]:
        return self.slice_.devices

    @property
    def kind(self) -> str:
        return self.slice_.name


def describe_host(devices: list[Any]) -> Host:
    device = devices[0]
    chip = chip_of_device(device.device_kind)
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        limit, source = int(stats["bytes_limit"]), "the runtime's bytes_limit"
    elif chip is not None:
        limit, source = chip.usable_hbm_bytes, f"{chip.generation}'s usable HBM"
    else:  # CPU devices share the host's memory
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // len(devices)
        source = f"host RAM shared by {len(devices)} device{'s' if len(devices) > 1 else ''}"
    return Host(Slice(device.device_kind, tuple(devices), 1, len(devices)), device.platform, chip, limit, source)


def memory_target(component: str, host: Host) -> Target:
    """What the plan's fit check and advice read, for this host: its usable memory as a chip's.
    Where the peaks are unknown (the CPU) they are NaN, so nothing can turn them into a figure."""
    figures = host.chip or Chip(host.platform, host.memory_limit, math.nan, math.nan, None, None, host.memory_limit)
    chip = dataclasses.replace(figures, usable_hbm_bytes=host.memory_limit)
    return Target(component, host.kind, chip, len(host.devices), 1, slice_=host.slice_)


def build(spec: RLJobSpec, host: Host, kinds: tuple[str, ...],
          progress: Any) -> tuple[list[Program], list[str], list[str]]:
    """The job's programs compiled for the host's devices, kept to run; notes; what could not be
    built on these devices, and why."""
    from stoker.model.attention_kernels import detect_backend
    from stoker.sizing.programs import learner_programs
    from stoker.sizing.programs_rollout import rollout_programs

    programs: list[Program] = []
    notes: list[str] = []
    unbuilt: list[str] = []
    learner = [k for k in kinds if k in LEARNER_KINDS]
    rollout = [k for k in kinds if k in ROLLOUT_KINDS]
    if learner:
        progress(f"compiling the learner's programs for {len(host.devices)} {host.kind} device(s) ...")
        try:
            programs += learner_programs(spec, host.slice_, backend=detect_backend(host.devices[0]), kinds=learner,
                                         keep=True, progress=progress, memory_limit=host.memory_limit)
        except ValueError as exc:  # a mesh the host's devices cannot take (learner.mesh)
            unbuilt.append(f"learner: {exc}")
    if rollout and spec.rollout is None:
        notes.append("no spec.rollout: the actors sample in their own processes, so there are no rollout programs")
    elif rollout:
        progress("compiling the rollout server's programs ...")
        try:
            programs += rollout_programs(spec, host.slice_, kinds=rollout, keep=True)
        except ValueError as exc:  # rollout.tensorParallel beyond the host's devices (MeshError)
            unbuilt.append(f"rollout: {exc}")
    return programs, notes, unbuilt


def program_devices(program: Program, host: Host) -> int:
    """The devices ``program`` runs on: a rollout server's tp mesh may take fewer than the host has."""
    import jax

    executable = program.compiled.executable
    if executable is None:
        return len(host.devices)
    shardings = [s for s in jax.tree.leaves(executable.input_shardings) if s is not None]
    return len(shardings[0].device_set) if shardings else len(host.devices)


def plan_figures(program: Program, spec: RLJobSpec, host: Host, devices: int) -> dict[str, Any]:
    """What ``stoker plan`` says of ``program`` on ``devices`` of this host: its terms, fit and bound."""
    target = memory_target(program.component, host)
    total = program.total
    ok = fits(program, target, total)
    bound = None
    if host.chip is not None:
        b = program_bound(program, host.chip, 1, devices)
        measured = calibration(host.chip.generation)
        bound = {"seconds": b.seconds, "compute_seconds": b.compute_seconds, "memory_seconds": b.memory_seconds,
                 "ici_seconds": b.ici_seconds, "dcn_seconds": b.dcn_seconds, "limit": b.limit,
                 "estimate_seconds": measured.estimate(b) if measured is not None else None}
    return {"terms": program.terms, "total_bytes": total, "limit_bytes": host.memory_limit, "fits": ok,
            "largest": program.largest, "advice": None if ok else advice(program, target, spec, total),
            "compiler_error": program.compiled.error, "bound": bound, "notes": program.notes}


def peak_bytes(devices: tuple[Any, ...]) -> int | None:
    """The devices' largest peak of bytes in use, where the backend counts it (not the CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    known = [int(p) for p in peaks if p is not None]
    return max(known) if known else None


def out_of_memory(exc: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(exc) or "out of memory" in str(exc).lower()


def free(*trees: Any) -> None:
    """Delete every device array in ``trees`` now, not when the last reference goes: the next
    program must find the memory this one held (a leftover made the next fail on a TPU)."""
    import jax

    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def run(program: Program, repeats: int, phase: Phase | None = None) -> tuple[float, list[float]]:
    """The first run's seconds (a warm-up: the transfer of its arguments, first-touch of memory)
    and ``repeats`` timed runs' seconds, each to its last output being ready. ``phase`` follows
    where it is, for a report of where it stopped."""
    import jax

    phase = phase or Phase()
    executable = program.compiled.executable
    assert program.inputs is not None and executable is not None
    args: list[Any] = []
    out: Any = None
    try:
        phase.enter("making inputs")
        args = list(jax.block_until_ready(program.inputs(executable.input_shardings[0], SEED)))
        phase.enter("first run")
        started = time.perf_counter()
        out = jax.block_until_ready(executable(*args))
        first = time.perf_counter() - started
        times = []
        for index in range(repeats):
            for arg, output in program.carry:  # a donated argument: the last run's output takes its place
                args[arg] = out[output]
            phase.enter(f"timed run {index + 1} of {repeats}")
            started = time.perf_counter()
            out = jax.block_until_ready(executable(*args))
            times.append(time.perf_counter() - started)
        return first, times
    finally:
        free(args, out)


def base_row(program: Program, spec: RLJobSpec, host: Host, repeats: int) -> dict[str, Any]:
    """A program's row before it runs: what it is and what the plan says of it."""
    devices = program_devices(program, host)
    return {
        "component": program.component, "program": program.name, "shape": program.shape, "devices": devices,
        "status": "ran",
        "reason": None, "compile_seconds": round(program.compiled.seconds, 4), "first_run_seconds": None,
        "seconds": None, "seconds_min": None, "repeats": repeats, "tokens": program.tokens or None,
        "tokens_per_second": None, "model_flops": program.model_flops or None, "mfu": None,
        "peak_bytes_per_device": None, "plan": plan_figures(program, spec, host, devices),
    }


def skipped(program: Program, spec: RLJobSpec, host: Host, reason: str) -> dict[str, Any]:
    row = base_row(program, spec, host, 0)
    row.update(status="not run", reason=reason)
    return row


def first_step_seconds(rows: list[dict[str, Any]]) -> float | None:
    """What a learner's first step costs on a cold start: its first bucket's grad and the apply,
    each compiled and run once (None unless both ran)."""
    grads = [r for r in rows if r["component"] == "learner" and r["program"].startswith("grad")]
    apply = [r for r in rows if r["component"] == "learner" and r["program"] == "apply"]
    if not grads or not apply or any(r["status"] != "ran" for r in (grads[0], apply[0])):
        return None
    return sum(r["compile_seconds"] + r["first_run_seconds"] for r in (grads[0], apply[0]))


def measure(program: Program, spec: RLJobSpec, host: Host, repeats: int, progress: Any,
            timeout: float = PROGRAM_TIMEOUT_SECONDS) -> dict[str, Any]:
    import jax

    row = base_row(program, spec, host, repeats)
    plan = row["plan"]
    if not plan["fits"]:
        why = plan["compiler_error"] or (f"{gib(plan['total_bytes'])} GiB per device of {gib(host.memory_limit)} GiB "
                                         f"({host.memory_source})")
        row.update(status="does not fit", reason=f"{why}; largest term {plan['largest']} "
                                                 f"{gib(plan['terms'][plan['largest']])} GiB. To fit: {plan['advice']}")
        return row
    what = f"{program.component} {program.name}"
    progress(f"running {what} ({program.shape}) ...")
    peak_before = peak_bytes(host.devices)
    phase = Phase()
    try:
        first, times = bounded(lambda: run(program, repeats, phase), timeout, what, phase, progress)
    except Unfinished as exc:
        row.update(status="did not finish", reason=f"still in its {exc.phase} after {exc.seconds:.0f} s "
                   f"(--program-timeout {exc.bound:.0f}); the device may still be running it, so nothing after it ran")
        return row
    except jax.errors.JaxRuntimeError as exc:  # the plan's check passed but the device refused
        if not out_of_memory(exc):
            raise
        target = memory_target(program.component, host)
        row.update(status="out of memory", reason=f"{str(exc).splitlines()[0][:300]}; largest planned term "
                   f"{plan['largest']} {gib(plan['terms'][plan['largest']])} GiB. To fit: "
                   f"{advice(program, target, spec, plan['total_bytes'])}")
        return row
    seconds = statistics.median(times)
    row.update(first_run_seconds=first, seconds=seconds, seconds_min=min(times))
    if program.tokens:
        row["tokens_per_second"] = program.tokens / seconds
    if host.chip is not None and program.model_flops:  # the same useful flops as the plan's MFU
        row["mfu"] = program.model_flops / (seconds * host.chip.peak_bf16_flops * row["devices"])
    if host.chip is not None and program.name == "decode":
        attainable = program.tokens / decode_attainable_seconds(program, host.chip, 1, row["devices"])
        row.update(attainable_tokens_per_second=attainable, share_of_attainable=row["tokens_per_second"] / attainable)
    peak = peak_bytes(host.devices)
    if peak is not None and (peak_before is None or peak > peak_before):
        row["peak_bytes_per_device"] = peak
    return row


def bench(spec: RLJobSpec, kinds: tuple[str, ...], repeats: int, progress: Any,
          timeout: float = PROGRAM_TIMEOUT_SECONDS) -> dict[str, Any]:
    import jax

    host = describe_host(jax.devices())
    programs, notes, unbuilt = build(spec, host, kinds, progress)
    cache = jax.config.values.get("jax_compilation_cache_dir")
    if cache:
        notes.append(f"JAX's persistent compilation cache is on ({cache}): a compile it already held is not cold")
    rows: dict[int, dict[str, Any]] = {}
    stuck = ""
    # The smallest first, so that each program's peak is likelier to rise above the ones before.
    for index, program in sorted(enumerate(programs), key=lambda item: item[1].total):
        if stuck:
            rows[index] = skipped(program, spec, host, f"not run: {stuck} did not finish before it")
            continue
        rows[index] = measure(program, spec, host, repeats, progress, timeout)
        if rows[index]["status"] == "did not finish":
            stuck = f"{program.component} {program.name}"
        else:
            program.compiled.executable = None  # its device code goes too (a stuck one's may still be running)
    result_rows = [rows[i] for i in range(len(programs))]
    return {
        "host": {"platform": host.platform, "device_kind": host.kind, "devices": len(host.devices),
                 "chip": host.chip.generation if host.chip else None,
                 "peak_flops_per_device": host.chip.peak_bf16_flops if host.chip else None,
                 "memory_limit_bytes_per_device": host.memory_limit, "memory_limit_source": host.memory_source},
        "repeats": repeats, "programs": result_rows, "not_built": unbuilt, "unfinished": bool(stuck),
        "first_step_seconds": first_step_seconds(result_rows),
        "notes": notes + ([PEAK_NOTE] if peak_bytes(host.devices) is not None else []),
        "fits": not unbuilt and all(r["status"] == "ran" for r in result_rows),
    }


def main(args: argparse.Namespace) -> int:
    job = load_job(args.file)
    kinds = args.programs or LEARNER_KINDS + ROLLOUT_KINDS

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = bench(job.spec, kinds, args.repeats, progress, float(args.program_timeout))
    print(json.dumps(result, indent=1) if args.json else render(result))
    if result["unfinished"]:
        # The unfinished program's thread may be inside a device call that never returns, and
        # interpreter shutdown would wait on the runtime it holds: leave now, the report written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_UNFINISHED)
    return 0 if result["fits"] else 1
