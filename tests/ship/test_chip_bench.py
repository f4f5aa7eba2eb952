"""benchmarks/chip.sh's bench part: its manifests are valid jobs whose programs the bench can
build, and benchmarks/bench_table.py turns the bench's JSON into the table the docs quote."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from stoker.manifest import load_job

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "benchmarks" / "chip").glob("*.yaml"))


def bench_table():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("stoker_benchmarks_bench_table", REPO / "benchmarks" / "bench_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chip_manifests_are_valid_jobs_for_one_v5e_chip() -> None:
    assert {m.stem for m in MANIFESTS} >= {"q05-2k", "q05-2k-rnone", "q05-8k", "dense-06b-bf16s", "moe-e8",
                                           "q05-roll-b8", "q05-roll-b32", "q05-roll-b128"}
    for manifest in MANIFESTS:
        spec = load_job(manifest).spec
        assert spec.learner.accelerator == "tpu-v5-lite-podslice" and spec.learner.topology == "1x1", manifest.name
        assert (spec.rollout is not None) == manifest.stem.startswith("q05-roll-"), manifest.name


def test_the_table_has_a_row_per_program_and_says_when_a_bench_left_no_report(tmp_path: Path) -> None:
    row = {"component": "rollout", "program": "decode", "shape": "128 rows, 256 slots", "status": "ran", "reason": None,
           "seconds": 0.004, "tokens_per_second": 32000.0, "mfu": 0.05, "peak_bytes_per_device": 3 * 2**30,
           "plan": {"bound": {"seconds": 0.0015}}, "share_of_attainable": 0.38}
    stuck = {**row, "component": "learner", "program": "apply", "shape": "one Adam update", "status": "did not finish",
             "reason": "still in its first run after 100 s", "seconds": None, "tokens_per_second": None, "mfu": None,
             "peak_bytes_per_device": None, "share_of_attainable": None}
    (tmp_path / "bench-q05-roll-b128.json").write_text(json.dumps({"programs": [row], "first_step_seconds": None}))
    (tmp_path / "bench-q05-2k.json").write_text(json.dumps({"programs": [stuck], "first_step_seconds": None}))
    (tmp_path / "bench-moe-e8.json").write_text("")  # killed before it printed
    text = bench_table().table(sorted(tmp_path.glob("bench-*.json")))
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    assert "| q05-roll-b128 | rollout decode | 128 rows, 256 slots | ran | 4.0 ms | 32,000 | 5.0% | 3.00 | 1.5 ms | 38% | - |" in text
    assert "| q05-2k | learner apply | one Adam update | did not finish: still in its first run after 100 s | -" in text
    assert "| moe-e8 | - | - | no report (killed, or refused: see its log) |" in text


def test_a_bench_gives_the_plans_calibration_its_rows(tmp_path: Path) -> None:
    """Each program that ran, bounded by compute or HBM, becomes a line sizing/calibration.py keeps."""
    from stoker.sizing.calibration import Measured

    ran = {"component": "learner", "program": "grad", "shape": "4 x 2048 tokens", "status": "ran", "reason": None,
           "seconds": 0.3464, "plan": {"bound": {"seconds": 0.1342, "limit": "compute"}}}
    ici = {**ran, "program": "apply", "plan": {"bound": {"seconds": 0.01, "limit": "ICI"}}}
    stuck = {**ran, "program": "publish", "status": "did not finish", "seconds": None}
    (tmp_path / "bench-q05-2k.json").write_text(json.dumps({"programs": [ran, ici, stuck]}))
    (tmp_path / "bench-moe-e8.json").write_text("")
    (line,) = bench_table().calibration_lines(sorted(tmp_path.glob("bench-*.json")))
    measured = eval(line.strip().rstrip(","), {"Measured": Measured})  # noqa: S307 - the line is Python by design
    assert (measured.manifest, measured.program, measured.limit) == ("q05-2k", "grad 4 x 2048 tokens", "compute")
    assert (measured.seconds, measured.bound_seconds) == (0.3464, 0.1342)

def test_the_bench_part_runs_each_manifest_and_writes_its_table(tmp_path: Path) -> None:
    """chip.sh bench end to end, on the CPU with a tiny learner job in place of the chip's manifests."""
    manifests, out = tmp_path / "manifests", tmp_path / "out"
    manifests.mkdir()
    (manifests / "tiny.yaml").write_text(
        "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: tiny}\nspec:\n"
        "  model: {architecture: {vocabSize: 256, hiddenSize: 64, numLayers: 1, numHeads: 4, numKvHeads: 2,"
        " intermediateSize: 128, maxSeqLen: 512}}\n"
        "  environment: {name: frozenlake, maxTurns: 3}\n  buffer: {groupSize: 4}\n"
        "  learner: {batchGroups: 2, sequenceBuckets: [128]}\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(out), "CHIP_WORK": str(tmp_path / "work"),
           "CHIP_MANIFESTS": str(manifests), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "chip.sh"), "bench"], env=env, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bench tiny: exit 0" in (out / "chip.log").read_text()
    assert [p["program"] for p in json.loads((out / "bench-tiny.json").read_text())["programs"]] == ["grad 128", "apply", "publish"]
    table = (out / "bench.md").read_text()
    assert "| tiny | learner grad 128 | 4 x 128 tokens | ran |" in table and "| tiny | learner apply |" in table
    assert not (out / "chip.md").exists()  # the loop runs' table belongs to the other parts
