"""What the FrozenLake benchmarks share: fresh `stoker run` invocations and reading their records.

Imported by the scripts beside it (`python benchmarks/<script>.py` puts this folder on the path).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stoker.runner.report import read_jsonl, time_to_reach

REPO = Path(__file__).resolve().parent.parent


def manifest_variant(base: Path, path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """Write ``base`` with ``edit`` applied to its parsed document to ``path``."""
    doc = yaml.safe_load(base.read_text())
    doc.setdefault("spec", {})
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def set_path(doc: dict[str, Any], dotted: str, value: str) -> None:
    """``spec.<dotted> = value`` (YAML-parsed), creating sections on the way."""
    node = doc["spec"]
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = yaml.safe_load(value)


@dataclass
class RunRecords:
    metrics: list[dict[str, Any]]  # learner_metrics.jsonl
    buffer: list[dict[str, Any]]  # buffer_stats.jsonl (empty in sync mode)
    started: float  # when `stoker run` started: compilation counts against time to target

    @property
    def steps(self) -> int:
        return int(self.metrics[-1]["step"]) if self.metrics else 0

    @property
    def wall_seconds(self) -> float | None:
        return self.metrics[-1]["time"] - self.started if self.metrics else None

    def final_success(self, steps: int = 10) -> float:
        last = self.metrics[-steps:]
        return sum(m.get("success_rate") or 0.0 for m in last) / max(len(last), 1)

    def seconds_to(self, target: float) -> float | None:
        return time_to_reach(self.metrics, "success_rate", target, start=self.started)


def fresh_run(manifest: Path, run_dir: Path, *options: str) -> RunRecords:
    """`stoker run manifest` in an emptied ``run_dir`` (a fresh start, not a resume); exits on failure."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [
        sys.executable, "-m", "stoker.cli", "run", str(manifest.resolve()), "--run-dir", str(run_dir.resolve()),
        "--no-progress", *options,
    ]
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    # From the run's folder, not the project root: there the folder stoker/ (the core alone) would
    # shadow an installed package (a wheel install, as on the TPU host) and its other components.
    result = subprocess.run(command, cwd=run_dir.parent, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
    runs = read_jsonl(run_dir / "runs.jsonl")
    started = runs[-1]["started_unix"] if runs else (metrics[0]["time"] if metrics else 0.0)
    return RunRecords(metrics, read_jsonl(run_dir / "buffer_stats.jsonl"), started)
