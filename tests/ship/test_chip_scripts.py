"""benchmarks/chip.sh's `step` and `flags` parts, on the CPU: the learner's whole step at a
manifest's size (real_step.py) and the grad step's variants (grad_flags.py) run and report what
the docs quote."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def script(name: str) -> ModuleType:
    sys.path.insert(0, str(REPO / "benchmarks"))  # the scripts import local_runs beside them
    try:
        spec = importlib.util.spec_from_file_location(f"stoker_benchmarks_{name}", REPO / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_the_whole_step_trains_several_micro_batches_and_reports_its_remat(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_step.py"), str(REPO / "examples" / "frozenlake.yaml"),
                           "--steps", "2", "--json", str(out)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    # The example's batch (4 groups of 8 episodes filling the 256-token bucket) is 8 micro-batches:
    # a step with a gradient sum beside each grad, as a run's.
    assert result["micro_batches"] > 1
    assert len(result["step_s"]) == 2 and all(s > 0 for s in result["step_s"])
    assert result["remat"].startswith("remat auto: none")  # the CPU's rule
    assert result["mfu"] is None and result["peak_bytes_in_use"] is None  # the CPU publishes neither


def test_a_variant_names_remat_blocks_and_flags_and_bad_ones_are_refused() -> None:
    flags = script("grad_flags")
    assert flags.variant("n=none/2048,1024/--xla_x=1 --xla_y=2") == ("n", "none", "2048,1024", "--xla_x=1 --xla_y=2")
    with pytest.raises(Exception, match="NAME=REMAT/BLOCKS/LIBTPU_ARGS"):
        flags.variant("none/-")
    table = flags.table([
        {"manifest": "q05-2k", "variant": "none", "seconds": 0.2911, "mfu": 0.461, "peak_bytes_per_device": 6283840512,
         "compile_seconds": 47.9, "wall_s": 75.0},
        {"manifest": "q05-2k", "variant": "slow", "error": "no answer in 180 s"},
    ])
    assert "| q05-2k | none | 291.1 ms | 46.1 % | 5.85 GiB | 47.9 s | 75.0 s |" in table
    assert "| q05-2k | slow | no answer in 180 s | n/a | n/a | – | – s |" in table


def test_the_colocated_manifest_runs_at_a_tiny_size_and_its_groups_train(tmp_path: Path) -> None:
    """chip.sh's `colocated` part (issue 52 item 4) with the 0.5B shape shrunk for the CPU: one
    process samples and trains, the report splits the step, and the task's reward is spread within
    groups so that the batch trains (what the figures rest on)."""
    import yaml

    doc = yaml.safe_load((REPO / "benchmarks" / "colocated" / "q05.yaml").read_text())
    spec = doc["spec"]
    assert spec["mode"] == "colocated" and spec["learner"]["accelerator"] == "tpu-v5-lite-podslice"
    spec["model"]["architecture"].update(vocabSize=264, hiddenSize=64, numLayers=2, numHeads=4, numKvHeads=2,
                                         intermediateSize=128)
    for key in ("accelerator", "topology"):
        del spec["learner"][key]
    spec["environment"]["tasks"] = [str(REPO / task) for task in spec["environment"]["tasks"]]
    manifest, run_dir = tmp_path / "tiny.yaml", tmp_path / "run"
    manifest.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir),
                           "--max-steps", "2", "--no-progress"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "## Where a step's time went" in (run_dir / "report.md").read_text()
    steps = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line.strip()]
    assert all(step["trained_tokens"] > 0.9 * step["sampled_tokens"] for step in steps)  # nearly every group trains
