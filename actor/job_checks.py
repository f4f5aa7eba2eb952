"""A job's environment checked where it will run: task files load, plugins (environment,
rewards) import, and the model files exist.

Kept apart from ``stoker.manifest.validate_document`` because it imports user code: ``stoker
validate`` and ``stoker run`` call it, the buffer and the learner (which never run environments)
do not."""

from __future__ import annotations

from stoker.actor.datasets import eval_problems
from stoker.actor.plugins import environment_problems as plugin_problems
from stoker.actor.rewards import reward_problems
from stoker.manifest import Problem, model_path_problems
from stoker.spec import RLJob


def environment_problems(job: RLJob, source: str, *, local: bool | None = None) -> list[Problem]:
    """The environment's own checks (``model_path_problems`` with ``local``; None: a cpu learner
    runs here)."""
    if job.spec.algorithm.trains_on_dataset:
        return []  # no episodes are played: the environment only names the built-in tokenizer
    env = job.spec.environment
    problems = [*plugin_problems(env.name, env.options, env.tasks), *eval_problems(env), *reward_problems(env.reward.terms)]
    problems += model_path_problems(job.spec, local=local if local is not None else job.spec.learner.accelerator == "cpu")
    return [Problem(source, f"spec.{path}", message) for path, message in problems]
