"""``stoker plan JOB.yaml``: compile every device program of the job for its TPU slices with the
real TPU compiler (libtpu, no TPU needed), say per chip whether each fits in HBM and, from the
compiled cost analysis, how fast it can at best run.

Exit status: 0 when everything fits, 1 when a program does not, 2 for bad input, 3 without libtpu.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stoker.learner import packing
from stoker.manifest import load_job
from stoker.sizing.bound import decode_tokens_per_second, program_bound, step_bound
from stoker.sizing.calibration import calibration
from stoker.sizing.chips import GIB, Chip, chip, parse_topology, topology_name
from stoker.sizing.compiler import CompilerMissing, Slice, load_slice
from stoker.spec import MIN_BF16_WEIGHTS_LEARNING_RATE, RLJobSpec
from stoker.tpu import ACCELERATORS, TopologyError, slice_shape

if TYPE_CHECKING:
    from stoker.sizing.programs import Program

BOUND_NOTE = "bounds from the chips' published peaks (compute, HBM, ICI/DCN), not measurements: a real run is slower"
GPU_NOTE = ("rollout servers on nvidia-gpu: not compiled. XLA's CUDA compiler compiles for the GPU it finds on the "
            "machine (it needs a CUDA device and driver), so GPU programs cannot be compiled or sized here; run "
            "`stoker audit` on a GPU host instead")
# Terms that shard over every chip of the mesh: more chips shrink them proportionally.
STATE_TERMS = ("parameters", "optimizer", "gradients", "reference", "publish copy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="JOB.yaml", help="RLJob manifest")
    parser.add_argument("--topology", metavar="NAME",
                        help="size the learner for this slice instead of the manifest's, e.g. v5e:2x2, v5p:4x4x4, v6e:16x16")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (for CI and GitOps)")


@dataclass
class Target:
    component: str
    topology: str  # libtpu's name
    chip: Chip
    chips: int  # per slice
    num_slices: int
    programs: list[Program] = field(default_factory=list)
    slice_: Slice | None = None


def targets(spec: RLJobSpec, topology: str | None) -> tuple[list[Target], list[str]]:
    """What to compile (learner, rollout) and notes on what is not compiled."""
    out: list[Target] = []
    notes: list[str] = []
    learner = spec.learner
    if topology is not None:
        generation, shape = parse_topology(topology)
        accelerator = next(a for a, info in ACCELERATORS.items() if info.generation == generation)
        out.append(Target("learner", f"{generation}:{shape}", chip(generation), slice_shape(accelerator, shape).chips,
                          learner.num_slices))
    elif learner.accelerator == "cpu":
        notes.append("learner: accelerator cpu, nothing to compile for a TPU; --topology NAME (e.g. v5e:2x2) sizes it for a slice")
    else:
        name = topology_name(learner.accelerator, learner.topology)
        out.append(Target("learner", name, chip(name.split(":")[0]), slice_shape(learner.accelerator, learner.topology).chips,
                          learner.num_slices))
    rollout = spec.rollout
    if rollout is not None:
        if rollout.accelerator == "nvidia-gpu":
            notes.append(GPU_NOTE)
        elif rollout.accelerator == "cpu":
            notes.append("rollout servers: accelerator cpu, nothing to compile for a TPU")
        else:
            name = topology_name(rollout.accelerator, rollout.topology)
            out.append(Target("rollout", name, chip(name.split(":")[0]), slice_shape(rollout.accelerator, rollout.topology).chips, 1))
    return out, notes


def fits(program: Program, target: Target, per_chip: int) -> bool:
    return program.compiled.error is None and per_chip <= target.chip.usable_hbm_bytes


def advice(program: Program, target: Target, spec: RLJobSpec, per_chip: int) -> str:
    """What would make ``program`` fit, for its largest term."""
    hbm, largest = target.chip.usable_hbm_bytes, program.largest
    chips = target.chips * target.num_slices
    dpc = target.slice_.devices_per_chip if target.slice_ else 1
    state = sum(v for k, v in program.terms.items() if k in STATE_TERMS) * dpc
    rest = per_chip - state
    if largest in STATE_TERMS and program.component == "learner":
        stored = _stored_dtype_knobs(program, spec, dpc)
        if rest < hbm:
            need = math.ceil(chips * state / (hbm - rest))
            return "; ".join(stored + [
                f"more chips: parameters, optimizer state and gradients shard over all {chips} chips (fsdp x tp); "
                f"about {need} chips bring them to {(hbm - rest) / GIB:.1f} GiB per chip"])
        return "; ".join(stored + ["more chips, and fewer temporaries (below): what is not sharded state alone fills the chip"])
    if largest == "temporaries" and program.component == "learner" and not program.name.startswith("grad"):
        return (f"more chips: the {program.name} program's temporaries are per-parameter, sharded over all {chips} "
                "chips (fsdp x tp) like the state")
    if largest == "temporaries" and program.component == "learner":
        knobs: list[str] = []
        if spec.model.dtype == "float32":
            knobs.append("model.dtype: bfloat16 (activations in bfloat16; the master weights stay learner.weightDtype)")
        mesh = spec.learner.mesh
        if spec.model.architecture.num_experts and mesh.expert_capacity_factor is None:
            knobs.append("learner.mesh.expertCapacityFactor: 1.25 (each expert takes about 1.25x its even share of "
                         "a device's tokens, not all of them: numExperts/numExpertsPerTok times smaller dispatch "
                         "buffers and expert work; docs/moe.md)")
        if mesh.tp > 1 and not mesh.sequence_sharding:
            knobs.append(f"learner.mesh.sequenceSharding: true (each layer's saved input split over the tp={mesh.tp} chips)")
        knobs += [f"fewer rows per micro-batch (learner.microbatchTokens, now {packing.microbatch_tokens(spec, 'tpu')} "
                 f"tokens: {program.shape}); the temporaries grow with the rows"]
        # auto has already fallen back to full when nothing less fits.
        if spec.model.remat not in ("full", "auto"):
            knobs.append(f"model.remat: full (now {spec.model.remat})")
        if spec.model.attention not in ("splash", "auto"):
            knobs.append(f"model.attention: splash (now {spec.model.attention})")
        knobs.append(f"learner.mesh.tp > {spec.learner.mesh.tp} (splits each layer's activations)")
        return "; ".join(knobs)
    rollout = spec.rollout
    if program.component == "rollout" and rollout is not None:
        if largest in ("KV cache", "batch KV", "temporaries"):
            return (f"a smaller rollout.maxBatch (now {rollout.max_batch}: {2 * rollout.max_batch} conversations cached), "
                    f"shorter learner.sequenceBuckets (longest {max(spec.learner.sequence_buckets)} slots), or a larger slice "
                    "(rollout.tensorParallel splits the cache over key/value heads)")
        return "a larger slice: rollout.tensorParallel splits the parameters over more chips"
    return f"reduce {largest}"


def _stored_dtype_knobs(program: Program, spec: RLJobSpec, devices_per_chip: int) -> list[str]:
    """The learner's stored dtypes still at float32, the one for the largest term first, each with
    what it saves per chip."""
    terms, learner = program.terms, spec.learner
    knobs: list[tuple[bool, str]] = []
    if learner.optimizer_state_dtype == "float32" and terms.get("optimizer", 0):
        saved = terms["optimizer"] // 2 * devices_per_chip
        knobs.append((program.largest == "optimizer",
                      f"learner.optimizerStateDtype: bfloat16 (Adam's two moments in half the bytes, {gib(saved)} GiB "
                      "less per chip, for smaller steps once the second moment settles)"))
    # Not where the spec would refuse it: LoRA, or a rate whose updates bfloat16 weights would lose.
    if (learner.weight_dtype == "float32" and spec.model.lora is None
            and spec.algorithm.learning_rate >= MIN_BF16_WEIGHTS_LEARNING_RATE):
        saved = (terms.get("parameters", 0) + terms.get("gradients", 0)) // 2 * devices_per_chip
        knobs.append((program.largest in ("parameters", "gradients"),
                      f"learner.weightDtype: bfloat16 (parameters and gradients in half the bytes, {gib(saved)} GiB less "
                      "per chip, but bfloat16 weights lose every update below |w| x 2^-9)"))
    return [text for _, text in sorted(knobs, key=lambda knob: not knob[0])]


def build(spec: RLJobSpec, plan_targets: list[Target], progress: Any) -> None:
    # JAX, the learner and the model build the programs: not loaded for --help or a bad manifest.
    from stoker.sizing.programs import learner_programs
    from stoker.sizing.programs_rollout import rollout_programs

    for target in plan_targets:
        target.slice_ = load_slice(target.topology, target.chips, target.num_slices)
        progress(f"compiling the {target.component}'s programs for {target.topology}"
                 f"{f' x {target.num_slices} slices' if target.num_slices > 1 else ''} ...")
        if target.component == "learner":
            target.programs = learner_programs(spec, target.slice_, progress=progress,
                                               memory_limit=target.chip.usable_hbm_bytes)
        else:
            target.programs = rollout_programs(spec, target.slice_)


def report(spec: RLJobSpec, plan_targets: list[Target], notes: list[str]) -> dict[str, Any]:
    programs, summary = [], {}
    for target in plan_targets:
        dpc = target.slice_.devices_per_chip if target.slice_ else 1
        devices = target.chips * target.num_slices * dpc
        measured = calibration(target.chip.generation)
        estimates: dict[str, float] = {}
        for program in target.programs:
            per_chip = program.total * dpc
            ok = fits(program, target, per_chip)
            bound = program_bound(program, target.chip, dpc, devices)
            if measured is not None:
                estimates[program.name] = measured.estimate(bound)
            programs.append({
                "component": target.component, "program": program.name, "shape": program.shape,
                "topology": target.topology, "slices": target.num_slices, "hbm_bytes": target.chip.hbm_bytes,
                "usable_hbm_bytes": target.chip.usable_hbm_bytes,
                "terms": {k: v * dpc for k, v in program.terms.items()}, "total_bytes": per_chip, "fits": ok,
                "largest": program.largest, "advice": None if ok else advice(program, target, spec, per_chip),
                "compiler_error": program.compiled.error, "compile_seconds": round(program.compiled.seconds, 2),
                "flops": program.compiled.flops, "model_flops": program.model_flops, "bytes_accessed": program.compiled.bytes_accessed,
                "collective_bytes": program.compiled.collective_bytes, "notes": program.notes,
                "bound": {"seconds": bound.seconds, "compute_seconds": bound.compute_seconds,
                          "memory_seconds": bound.memory_seconds, "ici_seconds": bound.ici_seconds,
                          "dcn_seconds": bound.dcn_seconds, "limit": bound.limit},
                "estimate_seconds": estimates.get(program.name),
            })
        by_name = {p.name: p for p in target.programs}
        if target.component == "learner" and "apply" in by_name:
            longest = max(spec.learner.sequence_buckets)
            grad = by_name[f"grad {longest}"]
            step = step_bound(grad, by_name["apply"], by_name["publish"],
                              episodes=spec.learner.batch_groups * spec.buffer.group_size, rows=grad.tokens // longest,
                              publish_interval=spec.learner.publish_interval_steps, chip=target.chip, devices=devices,
                              devices_per_chip=dpc)
            learner_summary: dict[str, Any] = {"step_seconds_bound": step.seconds, "mfu_bound": step.mfu,
                                               "micro_batches": step.micro_batches, "bucket": longest}
            if estimates:
                # As the bound, with each program's calibrated estimate (sizing/calibration.py).
                seconds = (step.micro_batches * estimates[grad.name] + estimates["apply"]
                           + estimates["publish"] / spec.learner.publish_interval_steps)
                learner_summary["step_seconds_estimate"] = seconds
                learner_summary["mfu_estimate"] = step.mfu * step.seconds / seconds
            if grad.remat is not None:
                learner_summary["remat"] = {"setting": grad.remat.setting, "policy": grad.remat.policy,
                                            "reason": grad.remat.reason, "peak_bytes": dict(grad.remat.peaks)}
            summary["learner"] = learner_summary
        if target.component == "rollout" and "decode" in by_name:
            summary["rollout"] = {"decode_tokens_per_second_bound": decode_tokens_per_second(by_name["decode"], target.chip, dpc, devices),
                                  "max_batch": spec.rollout.max_batch if spec.rollout else 0}
    return {"programs": programs, **summary, "notes": notes, "bound_note": BOUND_NOTE,
            "fits": all(p["fits"] for p in programs)}


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def render(result: dict[str, Any], plan_targets: list[Target]) -> str:
    lines: list[str] = []
    for target in plan_targets:
        rows = [p for p in result["programs"] if p["component"] == target.component]
        if not rows:
            continue
        slices = f" x {target.num_slices} slices" if target.num_slices > 1 else ""
        lines.append(f"{target.component} on TPU {target.topology}{slices}: {target.chips} chips of "
                     f"{gib(target.chip.hbm_bytes)} GiB HBM, {gib(target.chip.usable_hbm_bytes)} usable ({rows[0]['notes'][0]})")
        lines += [f"  note: {n}" for n in rows[0]["notes"][1:]]
        terms = list(dict.fromkeys(k for p in rows for k in p["terms"]))
        # GiB, or MiB for a table whose every program is under 1 GiB (a small model).
        unit, scale = ("GiB", GIB) if max(p["total_bytes"] for p in rows) >= GIB else ("MiB", 2**20)
        header = f"  {'program':<10} {'shape':<26}" + "".join(f"{t:>13}" for t in terms) + f"{'total':>10}  {unit} per chip"
        lines.append(header)
        for p in rows:
            cells = "".join(f"{p['terms'][t] / scale:>13.2f}" if t in p["terms"] else f"{'-':>13}" for t in terms)
            verdict = "OK" if p["fits"] else "DOES NOT FIT"
            b = p["bound"]
            estimate = f", ~{_seconds(p['estimate_seconds'])} as measured" if p.get("estimate_seconds") else ""
            lines.append(f"  {p['program']:<10} {p['shape']:<26}{cells}{p['total_bytes'] / scale:>10.2f}  {verdict:<12} "
                         f">= {_seconds(b['seconds'])} ({b['limit']}-bound){estimate}, compiled in {p['compile_seconds']:.1f} s")
        if target.component == "learner" and "learner" in result:
            s = result["learner"]
            lines.append(f"  step >= {_seconds(s['step_seconds_bound'])} at full-length episodes ({s['micro_batches']} x grad "
                         f"{s['bucket']} + apply + publish), MFU <= {s['mfu_bound']:.0%}")
            if "step_seconds_estimate" in s:
                lines.append(f"  step ~{_seconds(s['step_seconds_estimate'])}, MFU ~{s['mfu_estimate']:.0%}: the bound at the share "
                             f"of each peak this chip generation reached in `stoker bench` (sizing/calibration.py)")
        if target.component == "rollout" and "rollout" in result:
            s = result["rollout"]
            lines.append(f"  decode <= {s['decode_tokens_per_second_bound']:,.0f} tokens/s per server at maxBatch {s['max_batch']}")
    if result["programs"]:
        lines.append(f"({result['bound_note']})")
    for note in result["notes"]:
        lines.append(f"note: {note}")
    for p in result["programs"]:
        if p["fits"]:
            continue
        why = p["compiler_error"] or f"{gib(p['total_bytes'])} GiB per chip of {gib(p['usable_hbm_bytes'])} usable"
        lines.append(f"DOES NOT FIT: {p['component']} {p['program']} on {p['topology']}: {why}; largest term "
                     f"{p['largest']} {gib(p['terms'][p['largest']])} GiB. To fit: {p['advice']}")
    return "\n".join(lines)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def compile_only_environment() -> None:
    """The programs are compiled for abstract TPU devices; JAX itself needs no accelerator here, and
    probing for one only logs libtpu's start-up errors on a host without a TPU. Set by ``main``
    before JAX loads, not on import: ``stoker bench`` imports this module's fit check and runs on
    the host's real devices."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def main(args: argparse.Namespace) -> int:
    compile_only_environment()
    job = load_job(args.file)
    try:
        plan_targets, notes = targets(job.spec, args.topology)
    except TopologyError as exc:
        print(f"stoker plan: {exc}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        build(job.spec, plan_targets, progress)
    except CompilerMissing as exc:
        print(f"stoker plan: {exc}", file=sys.stderr)
        return 3
    result = report(job.spec, plan_targets, notes)
    print(json.dumps(result, indent=1) if args.json else render(result, plan_targets))
    return 0 if result["fits"] else 1
