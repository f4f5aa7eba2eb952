"""Issue 37's two learning claims, side by side in one run (tiny models, CPU, `stoker run` each stage).

    .venv/bin/python benchmarks/stages.py [--seeds 0 1] [--out runs/bench-stages] [--no-jsd]

(a) SFT then RL against RL from scratch, per seed: examples/answers.yaml from a random policy,
    and examples/sft.yaml -> `stoker export` -> examples/answers-from-sft.yaml (the same GRPO job
    started from the export). Steps-to-target: the first RL learner step at which the mean reward
    of the last 10 learner steps (a full window: `stoker run --target-success` would also stop on
    a lucky first batch) reaches the target. This script stops each RL run (SIGINT, a clean stop)
    once it does, else the run ends at its maxSteps (600) or --minutes. The SFT stage's own
    steps are reported beside it.
(b) RL then distillation: the teacher is seed 0's SFT-then-RL export; the student
    (examples/answers-distill.yaml, hidden 32 against the teacher's 64, 27k parameters
    against 91k) distills from it for --student-steps (600) by reverse KL, and by generalized JSD
    (beta 0.5) unless --no-jsd. Teacher and student are then scored the same way: the exact
    expected reward on the task's 25 prompts under the actors' sampling (temperature 1, answers
    restricted to the ten digits), i.e. the mean probability of the correct digit, plus greedy
    accuracy. The answers task is the whole 0-4 addition table, so there is no held-out prompt a
    model this small could generalise to: both are scored on the same 25 prompts, exactly.

Writes OUT/results.json (with --only, OUT/results-ONLY.json) and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from local_runs import REPO, RunRecords, fresh_run, manifest_variant

EXAMPLES = REPO / "examples"
WINDOW = 10  # learner steps in the rolling mean, as stoker run's --target-success


def steps_to(metrics: list[dict[str, Any]], key: str, target: float) -> int | None:
    """The first learner step whose rolling mean of ``key`` (the last WINDOW steps) reaches ``target``."""
    recent: list[float] = []
    for record in metrics:
        if record.get(key) is None:
            continue
        recent = (recent + [float(record[key])])[-WINDOW:]
        if len(recent) == WINDOW and sum(recent) / WINDOW >= target:
            return int(record["step"])
    return None


def rolling(metrics: list[dict[str, Any]], step: int) -> float | None:
    """The mean reward of the WINDOW learner steps up to ``step``."""
    window = [float(r["reward_mean"]) for r in metrics if step - WINDOW < r["step"] <= step and r.get("reward_mean") is not None]
    return sum(window) / len(window) if window else None


def export(run_dir: Path, target: Path) -> Path:
    if target.exists():
        import shutil

        shutil.rmtree(target)
    command = [sys.executable, "-m", "stoker.cli", "export", str(run_dir), "--to", str(target)]
    print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    return target


def score(checkpoint: Path) -> dict[str, float]:
    """Exact expected reward and greedy accuracy of ``checkpoint`` on the answers task's prompts,
    laid out as the actors lay them out (the plain layout SFT trains on)."""
    import jax.numpy as jnp

    from stoker.conversation.tokenization import allowed_token_ids, text_interface
    from stoker.learner.sft import render_conversation
    from stoker.manifest import load_job
    from stoker.model.hf import load_checkpoint

    spec = load_job(EXAMPLES / "answers.yaml").spec
    interface = text_interface(spec)
    allowed = np.asarray(allowed_token_ids(spec))
    model = load_checkpoint(checkpoint)
    tasks = [json.loads(line) for line in (EXAMPLES / "answers" / "arithmetic.jsonl").read_text().splitlines() if line]
    probabilities, greedy = [], []
    for task in tasks:
        answer = str(task["answer"])
        messages = [{"role": "user", "content": task["prompt"]}, {"role": "assistant", "content": answer}]
        conversation = render_conversation(interface, messages)
        first = int(np.argmax(conversation.loss_mask))  # the answer's (one-digit) token
        ids = jnp.asarray(conversation.token_ids[None, :first])
        logits = np.asarray(model(ids, jnp.arange(first)[None], jnp.ones_like(ids)))[0, -1, allowed]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        correct = int(np.flatnonzero(allowed == conversation.token_ids[first])[0])
        probabilities.append(float(p[correct]))
        greedy.append(float(np.argmax(p) == correct))
    return {"expected_reward": float(np.mean(probabilities)), "greedy_accuracy": float(np.mean(greedy))}


def run_until(manifest: Path, run_dir: Path, target: float, minutes: float) -> RunRecords:
    """`stoker run` in a fresh ``run_dir``, stopped with SIGINT once ``steps_to(target)`` is reached."""
    import shutil
    import signal
    import time

    from stoker.runner.report import read_jsonl

    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-m", "stoker.cli", "run", str(manifest), "--run-dir", str(run_dir), "--no-progress",
               "--max-minutes", str(minutes)]
    print(f"$ {' '.join(command)}  # stopped at the target", file=sys.stderr, flush=True)
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    stopped = False
    while process.poll() is None:
        time.sleep(1.0)
        if not stopped and steps_to(read_jsonl(run_dir / "learner_metrics.jsonl"), "reward_mean", target) is not None:
            process.send_signal(signal.SIGINT)
            stopped = True
    if process.returncode != 0 and not stopped:
        raise SystemExit(f"run failed ({process.returncode}): see {log.name}")
    metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
    runs = read_jsonl(run_dir / "runs.jsonl")
    return RunRecords(metrics, [], runs[-1]["started_unix"] if runs else 0.0)


def rl_run(name: str, manifest: Path, out: Path, seed: int, target: float, minutes: float,
           checkpoint: Path | None = None) -> dict[str, Any]:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["seed"] = seed
        if checkpoint is not None:
            doc["spec"]["model"]["checkpoint"] = str(checkpoint)

    variant = manifest_variant(manifest, out / f"{name}.yaml", edit)
    run = run_until(variant, out / name, target, minutes)
    result = {
        "steps_to_target": steps_to(run.metrics, "reward_mean", target),
        "steps_run": run.steps,
        "first_reward": run.metrics[0].get("reward_mean") if run.metrics else None,
        "final_rolling_reward": run.final_success(),
        "wall_seconds": run.wall_seconds,
    }
    print(f"{name}: {json.dumps(result)}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock cap of each RL run")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-stages")
    parser.add_argument("--no-jsd", action="store_true", help="skip the generalized-JSD student")
    parser.add_argument("--student-steps", type=int, default=600, help="the distilled students' learner steps")
    parser.add_argument("--only", choices=("sft-rl", "distill"), help="run one of the two comparisons")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"target": args.target, "seeds": {}}
    results_file = out / ("results.json" if args.only is None else f"results-{args.only}.json")
    for seed in args.seeds if args.only != "distill" else []:
        row: dict[str, Any] = {}
        row["scratch"] = rl_run(f"scratch-{seed}", EXAMPLES / "answers.yaml", out, seed, args.target, args.minutes)
        sft_manifest = manifest_variant(
            EXAMPLES / "sft.yaml", out / f"sft-{seed}.yaml", lambda doc, s=seed: doc["spec"].__setitem__("seed", s)
        )
        sft = fresh_run(sft_manifest, out / f"sft-{seed}")
        sft_export = export(out / f"sft-{seed}", out / f"sft-{seed}-export")
        row["sft"] = {"steps": sft.steps, "final_loss": sft.metrics[-1].get("loss"), **score(sft_export)}
        print(f"sft-{seed}: {json.dumps(row['sft'])}", flush=True)
        row["from_sft"] = rl_run(
            f"from-sft-{seed}", EXAMPLES / "answers-from-sft.yaml", out, seed, args.target, args.minutes, sft_export
        )
        results["seeds"][seed] = row
        results_file.write_text(json.dumps(results, indent=2))

    if args.only == "sft-rl":
        print(json.dumps(results, indent=2))
        return 0
    teacher_run = out / f"from-sft-{args.seeds[0]}"
    teacher = export(teacher_run, out / "teacher-export")
    results["teacher"] = {"run": str(teacher_run), **score(teacher)}
    print(f"teacher: {json.dumps(results['teacher'])}", flush=True)
    results["students"] = {}
    for divergence in ["reverse_kl"] + ([] if args.no_jsd else ["jsd"]):
        def edit(doc: dict[str, Any], divergence: str = divergence) -> None:
            doc["spec"]["algorithm"]["teacher"] = {"checkpoint": str(teacher), "divergence": divergence}

        variant = manifest_variant(EXAMPLES / "answers-distill.yaml", out / f"student-{divergence}.yaml", edit)
        run = fresh_run(variant, out / f"student-{divergence}", "--max-steps", str(args.student_steps))
        student = export(out / f"student-{divergence}", out / f"student-{divergence}-export")
        last = run.metrics[-1] if run.metrics else {}
        results["students"][divergence] = {
            "steps": run.steps, "wall_seconds": run.wall_seconds,
            "first_reverse_kl": run.metrics[0].get("reverse_kl") if run.metrics else None,
            "final_reverse_kl": last.get("reverse_kl"), "final_jsd": last.get("jsd"),
            # the training batches' mean reward over 10 steps, half way and at the end
            "rolling_reward_half_way": rolling(run.metrics, args.student_steps // 2),
            "rolling_reward_end": rolling(run.metrics, run.steps),
            **score(student),
        }
        gap = results["teacher"]["expected_reward"] - results["students"][divergence]["expected_reward"]
        results["students"][divergence]["points_below_teacher"] = 100 * gap
        print(f"student-{divergence}: {json.dumps(results['students'][divergence])}", flush=True)
        results_file.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
