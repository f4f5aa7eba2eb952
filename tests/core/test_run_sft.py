"""`stoker run` on the SFT example: the learner alone (no buffer, no actors), the held-out loss in
its metrics, and an export the next stage can start from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_sft_example_runs_the_learner_alone_and_exports(tmp_path: Path) -> None:
    run_dir = tmp_path / "sft"
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", "examples/sft.yaml", "--run-dir", str(run_dir), "--no-progress",
         "--max-steps", "12"],
        capture_output=True, text=True, cwd=REPO, timeout=400,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["learner.log"]  # no buffer, no actors
    records = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == list(range(1, 13))
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [10, 12]  # every evalIntervalSteps updates, and after the last
    assert records[-1]["loss"] < records[0]["loss"]
    exported = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "export", str(run_dir), "--to", str(tmp_path / "export")],
        capture_output=True, text=True, timeout=200,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    from stoker.model.hf import load_checkpoint
    from stoker.model.weights import WeightSubscriber, flatten_params

    version, published = WeightSubscriber(directory=run_dir / "weights").fetch_latest()
    assert version == 12
    reloaded = flatten_params(load_checkpoint(tmp_path / "export"))
    for name, array in published.items():
        np.testing.assert_array_equal(np.asarray(reloaded[name]), np.asarray(array))
