"""The verifiable-answers environment and JSONL task datasets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stoker.actor.answers import AnswersEnvironment
from stoker.actor.datasets import load_task_file
from stoker.actor.environments import EnvironmentProblem
from stoker.actor.settings import ActorSettings
from stoker.spec import EnvironmentSpec, ModelSpec, RLJobSpec, TransformerConfig

REPO = Path(__file__).resolve().parents[2]

TASKS: list[dict[str, Any]] = [
    {"id": "capital", "prompt": "Capital of France?", "verifier": "exact", "answer": "Paris"},
    {"id": "cased", "prompt": "Say ABC", "verifier": "exact", "answer": "ABC", "caseSensitive": True},
    {"id": "gsm", "prompt": "Tom has 3 apples and buys 1,204 more.", "verifier": "numeric", "answer": 1207},
    {"id": "pi", "prompt": "pi to 2 places", "verifier": "numeric", "answer": 3.14159, "tolerance": 0.01},
    {"id": "date", "prompt": "A date", "verifier": "regex", "pattern": r"\d{4}-\d{2}-\d{2}"},
    {"id": "add", "prompt": "Write add(a, b)", "verifier": "python", "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
    {
        "id": "square",
        "prompt": "Write square(x)",
        "verifier": "python",
        "tests": "import unittest\nfrom solution import square\n\nclass T(unittest.TestCase):\n"
        "    def test_square(self):\n        self.assertEqual(square(3), 9)\n",
    },
]


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(task) + "\n" for task in TASKS))
    return path


def _score(task_file: Path, workdir: Path, task: str, answer: str) -> float:
    env = AnswersEnvironment.from_options({"taskFiles": [str(task_file)]}, str(workdir))
    assert env.reset(task, 0).text == next(t["prompt"] for t in TASKS if t["id"] == task)
    result = env.step(answer)
    assert result.terminated and result.observation.info["metrics"]["success"] == result.reward
    return result.reward


@pytest.mark.parametrize(
    ("task", "answer", "reward"),
    [
        ("capital", "  paris \n", 1.0),
        ("capital", "Lyon", 0.0),
        ("cased", "abc", 0.0),
        ("cased", "ABC", 1.0),
        ("gsm", "3 + 1204 = 1207", 1.0),
        ("gsm", "1207 apples, or 1208?", 0.0),  # the last number is the answer
        ("gsm", "I don't know", 0.0),
        ("pi", "about 3.14", 1.0),
        ("pi", "3.2", 0.0),
        ("date", "2026-12-01", 1.0),
        ("date", "on 2026-12-01", 0.0),
        ("add", "```python\ndef add(a, b):\n    return a + b\n```", 1.0),
        ("add", "def add(a, b):\n    return a - b\n", 0.0),
        ("add", "import os\nos._exit(0)\n", 0.0),
        ("add", "import unittest\nunittest.TestCase.run = lambda self, result=None: result.addSuccess(self)\n", 0.0),
        ("square", "def square(x):\n    return x * x\n", 1.0),
        ("square", "def square(x):\n    return x + x\n", 0.0),
    ],
)
def test_each_verifier_scores_right_and_wrong_answers(task_file: Path, tmp_path: Path, task: str, answer: str, reward: float) -> None:
    assert _score(task_file, tmp_path, task, answer) == reward


def test_task_files_explain_their_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    for text, message in [
        ('{"id": "a"}\nnot json\n', "bad.jsonl:2: not JSON"),
        ('{"prompt": "x"}\n', "bad.jsonl:1: expected an object with an id"),
        ('{"id": "a"}\n{"id": "a"}\n', "duplicate task id 'a'"),
        ("\n", "no tasks"),
    ]:
        bad.write_text(text)
        with pytest.raises(EnvironmentProblem, match=message):
            load_task_file(bad)
    with pytest.raises(EnvironmentProblem, match="No such file"):
        load_task_file(tmp_path / "missing.jsonl")


def test_a_job_plays_the_file_s_tasks_and_validate_checks_it(task_file: Path, tmp_path: Path) -> None:
    spec = RLJobSpec(
        environment=EnvironmentSpec(name="answers", tasks=[str(task_file)]),
        model=ModelSpec(architecture=TransformerConfig(vocab_size=320)),
    )
    settings = ActorSettings.from_spec(spec, actor_id="a")
    assert settings.tasks == tuple(t["id"] for t in TASKS)
    assert json.loads(settings.sandbox.options_json)["taskFiles"] == [str(task_file)]
    env = AnswersEnvironment.from_options(json.loads(settings.sandbox.options_json), str(tmp_path))
    with pytest.raises(EnvironmentProblem, match="unknown task 'nope'"):
        env.reset("nope", 0)
    manifest = tmp_path / "job.yaml"
    manifest.write_text("apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nspec:\n  environment: {name: answers}\n")
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "validate", str(manifest)], capture_output=True, text=True)
    assert done.returncode == 2 and "spec.environment.tasks: missing" in done.stderr


def test_the_example_dataset_is_what_its_generator_writes() -> None:
    sys.path.insert(0, str(REPO / "examples" / "answers"))
    try:
        import make_dataset
    finally:
        sys.path.pop(0)
    written = (REPO / "examples" / "answers" / "arithmetic.jsonl").read_text()
    assert written == "".join(json.dumps(task) + "\n" for task in make_dataset.tasks())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_example_job_runs_from_the_repository_root(tmp_path: Path, mode: str, jax_env: dict[str, str]) -> None:
    """A short run of examples/answers.yaml; that it learns (0.9 success) is measured in docs/environments.md.
    In sync mode its batch (4 groups of 8 episodes) outnumbers an actor's concurrency (8)."""
    done = subprocess.run(
        [sys.executable, "-m", "stoker.cli", "run", "examples/answers.yaml", "--run-dir", str(tmp_path), "--no-progress",
         "--max-steps", "3", "--mode", mode],
        capture_output=True, text=True, cwd=REPO, timeout=400, env=jax_env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "learner_metrics.jsonl").read_text().splitlines() if line]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert "success" in (tmp_path / "report.md").read_text()


def test_sync_mode_caches_a_conversation_for_every_episode_of_its_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.actor.wiring import conversation_rows
    from stoker.manifest import load_job
    from stoker.runner.sync import episode_settings

    monkeypatch.chdir(REPO)  # the job's task file is relative to the repository root
    spec = load_job(REPO / "examples" / "answers.yaml").spec
    settings = episode_settings(spec, "answers")
    batch = spec.learner.batch_groups * spec.buffer.group_size
    assert batch > spec.actors.concurrency
    assert settings.concurrency == batch
    assert conversation_rows(settings, settings.model, "float32") == batch


def test_attempts_make_an_answers_episode_multi_turn(task_file: Path, tmp_path: Path) -> None:
    env = AnswersEnvironment.from_options({"taskFiles": [str(task_file)], "attempts": 3}, str(tmp_path))
    env.reset("gsm", 0)
    first = env.step("I don't know")
    assert not first.terminated and first.reward == 0.0
    assert first.observation.text == "incorrect: no number in the answer; try again (2 attempts left)"
    second = env.step("1207")
    assert second.terminated and second.reward == 1.0 and second.observation.text == "correct"
    env.reset("capital", 0)  # a fresh episode gets all its attempts back
    results = [env.step("Lyon") for _ in range(3)]
    assert [r.terminated for r in results] == [False, False, True] and results[-1].observation.text == "incorrect"
    with pytest.raises(EnvironmentProblem, match="attempts 0"):
        AnswersEnvironment.from_options({"taskFiles": [str(task_file)], "attempts": 0}, str(tmp_path)).reset("gsm", 0)


@pytest.mark.asyncio
async def test_a_multi_turn_answers_episode_trains_on_every_attempt(task_file: Path, tmp_path: Path) -> None:
    from stoker.actor.episode import OK, EpisodeLimits, run_episode
    from stoker.actor.policy import ScriptedPolicy
    from stoker.actor.sandbox import InlineEnvironment
    from stoker.conversation.tokenization import EOT, TextInterface, byte_tokenizer

    tokenizer = byte_tokenizer()
    interface = TextInterface(tokenizer, (), (), (tokenizer.token_to_id(EOT),))
    answers = iter(["no idea", "1207"])

    def respond(prompt: object) -> list[int]:
        return [*tokenizer.encode(next(answers), add_special_tokens=False).ids, tokenizer.token_to_id(EOT)]

    env = AnswersEnvironment.from_options({"taskFiles": [str(task_file)], "attempts": 3}, str(tmp_path))
    episode = await run_episode(
        ScriptedPolicy(respond), InlineEnvironment(env, blocking=False), interface, "gsm",  # type: ignore[arg-type]
        seed=0, limits=EpisodeLimits(max_turns=3, max_new_tokens=16, max_tokens=512),
    )
    assert episode.status == OK and episode.num_turns == 2 and episode.turn_rewards == [0.0, 1.0]
    assert "try again" in interface.decode(episode.token_ids.tolist())  # the verdict is part of the context
