"""`stoker run` on the SFT example: the learner alone (no buffer, no actors), the held-out loss in
its metrics, and an export the next stage can start from; then the two stage chains of
docs/stages.md from that export (SFT -> RL -> distillation), each stage through `stoker run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def stoker(env: dict[str, str], *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "stoker.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=400, env=env)
    assert done.returncode == 0, f"stoker {' '.join(args)}:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def env(jax_cache_env: dict[str, str]) -> dict[str, str]:
    """The session's compilation cache (tests/conftest.py): the RL stage samples with the model
    examples/answers.yaml trains (tests/actor/test_answers.py)."""
    return {**os.environ, **jax_cache_env}


@pytest.fixture(scope="module")
def sft_stage(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Path:
    """examples/sft.yaml for 12 steps and its export (tmp/sft, tmp/export), run once."""
    tmp_path = tmp_path_factory.mktemp("stages")
    stoker(env, "run", "examples/sft.yaml", "--run-dir", str(tmp_path / "sft"), "--no-progress", "--max-steps", "12")
    stoker(env, "export", str(tmp_path / "sft"), "--to", str(tmp_path / "export"))
    return tmp_path


def test_sft_example_runs_the_learner_alone_and_exports(sft_stage: Path) -> None:
    tmp_path = sft_stage
    run_dir = tmp_path / "sft"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["learner.log"]  # no buffer, no actors
    records = [json.loads(line) for line in (run_dir / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == list(range(1, 13))
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(evals) == [10, 12]  # every evalIntervalSteps updates, and after the last
    assert records[-1]["loss"] < records[0]["loss"]
    from stoker.model.hf import load_checkpoint
    from stoker.weights.channel import WeightSubscriber, flatten_params

    version, published = WeightSubscriber(directory=run_dir / "weights").fetch_latest()
    assert version == 12
    reloaded = flatten_params(load_checkpoint(tmp_path / "export"))
    for name, array in published.items():
        np.testing.assert_array_equal(np.asarray(reloaded[name]), np.asarray(array))


def example(tmp_path: Path, name: str, edit: Any) -> Path:
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    edit(doc["spec"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def weights(run_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    from stoker.weights.channel import WeightSubscriber

    subscriber = WeightSubscriber(directory=run_dir / "weights")
    latest = subscriber.fetch_latest()
    assert latest is not None
    return {v: {k: np.asarray(a) for k, a in subscriber.fetch(v).items()} for v in (0, latest[0])}


def exported(directory: Path) -> dict[str, np.ndarray]:
    from stoker.model.hf import load_checkpoint
    from stoker.weights.channel import flatten_params

    return {k: np.asarray(v) for k, v in flatten_params(load_checkpoint(directory)).items()}


@pytest.mark.timeout(900)  # two `stoker run`s with actors, two exports
def test_sft_then_rl_then_distillation_each_from_the_previous_export(sft_stage: Path, env: dict[str, str]) -> None:
    """answers-from-sft.yaml on the SFT export (its version 0 is that export, and it trains from
    there), then answers-distill.yaml with that RL stage's export as the teacher."""
    tmp_path = sft_stage

    def from_sft(spec: dict[str, Any]) -> None:
        spec["model"]["checkpoint"] = str(tmp_path / "export")
        spec["actors"]["replicas"] = 1

    rl = example(tmp_path, "answers-from-sft.yaml", from_sft)
    stoker(env, "run", str(rl), "--run-dir", str(tmp_path / "rl"), "--no-progress", "--max-steps", "1")
    published = weights(tmp_path / "rl")
    assert sorted(published) == [0, 1]
    sft = exported(tmp_path / "export")
    for name, array in sft.items():  # the RL stage's version 0 is the SFT stage's policy
        np.testing.assert_array_equal(published[0][name], array, err_msg=name)
    assert any(not np.array_equal(published[1][k], sft[k]) for k in sft)  # and it trained from there
    stoker(env, "export", str(tmp_path / "rl"), "--to", str(tmp_path / "rl-export"))

    def from_teacher(spec: dict[str, Any]) -> None:
        spec["algorithm"]["teacher"]["checkpoint"] = str(tmp_path / "rl-export")
        spec["actors"]["replicas"] = 1

    distill = example(tmp_path, "answers-distill.yaml", from_teacher)
    stoker(env, "run", str(distill), "--run-dir", str(tmp_path / "student"), "--no-progress", "--max-steps", "2")
    records = [json.loads(line) for line in (tmp_path / "student" / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["reverse_kl"] > 0 for r in records)  # scored under the RL stage's export
    stoker(env, "export", str(tmp_path / "student"), "--to", str(tmp_path / "student-export"))
    student = exported(tmp_path / "student-export")
    assert student["model.embed_tokens.weight"].shape == (264, 32)  # the smaller student
    assert exported(tmp_path / "rl-export")["model.embed_tokens.weight"].shape == (264, 64)
