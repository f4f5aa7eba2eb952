"""The generated RLJob field reference and ``stoker explain``; model paths that are not on this
machine fail ``stoker validate`` and ``stoker run`` before anything starts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stoker import cli
from stoker.conversation.tokenization import TokenizerProblem, environment_tokenizer
from stoker.spec import RLJob, RLJobSpec
from stoker.spec_reference import REFERENCE_PATH, all_fields, explain, render_reference

MINIMAL = "apiVersion: stoker.dev/v1alpha1\nkind: RLJob\nmetadata: {name: t}\n"


def test_committed_reference_is_current() -> None:
    assert REFERENCE_PATH.read_text() == render_reference(), "docs/rljob-reference.md is stale: run `stoker explain --write`"


def test_every_spec_field_is_in_the_reference_with_its_bounds() -> None:
    paths = {f.path: f for f in all_fields()}
    # Every leaf that validates: dump a default job and look each key up.
    def leaves(value: object, prefix: str) -> list[str]:
        if isinstance(value, dict) and value:
            return [p for k, v in value.items() for p in [f"{prefix}.{k}", *leaves(v, f"{prefix}.{k}")]]
        return []

    dumped = RLJob().model_dump(by_alias=True, mode="json")
    missing = [p.lstrip(".") for p in leaves(dumped, "") if p.lstrip(".") not in paths]
    assert not missing, missing
    top_p = paths["spec.actors.sampling.topP"]
    assert (top_p.type, top_p.default, top_p.bounds) == ("number", "`1.0`", "> 0, <= 1")
    assert paths["spec.environment.reward.terms[].function"].default == "required"
    assert paths["spec.learner.logSamplesEverySteps"].bounds == ">= 0, <= 1000000"


def test_explain_prints_a_field_or_a_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert [f.path for f in explain("actors.sampling.topP")] == ["spec.actors.sampling.topP"]
    assert [f.path for f in explain("sampling.topP")] == ["spec.actors.sampling.topP"]  # a unique tail
    section = [f.path for f in explain("spec.actors.sampling")]
    assert section[0] == "spec.actors.sampling" and "spec.actors.sampling.maxNewTokens" in section
    assert cli.main(["explain", "spec.buffer.maxStaleness"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("spec.buffer.maxStaleness  <integer>") and "default: " in out
    assert cli.main(["explain", "spec.actors.samplin"]) == 2
    assert "did you mean spec.actors.sampling" in capsys.readouterr().err


def _validate(tmp_path: Path, body: str) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(MINIMAL + body)
    from stoker.validate_cmd import main

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argparse.Namespace(files=[str(path)]))
    return code, err.getvalue()


def test_a_missing_local_checkpoint_fails_validate_with_advice_that_fits(tmp_path: Path) -> None:
    code, err = _validate(tmp_path, f"spec:\n  model: {{checkpoint: {tmp_path / 'qwen-tiny-typo'}}}\n")
    assert code == 2
    assert "spec.model.checkpoint:" in err and "does not exist" in err
    assert "Hugging Face checkpoint directory on this machine" in err and "gs://" in err
    assert "tokenizer" not in err.split("expected")[0]  # no advice about picking a tokenizer
    code, err = _validate(tmp_path, "spec:\n  model: {tokenizer: /nope/tokenizer.json, chatTemplate: /nope.jinja}\n")
    assert code == 2 and "spec.model.tokenizer:" in err and "spec.model.chatTemplate:" in err


def test_uris_and_the_paths_of_a_tpu_job_are_left_to_the_cluster(tmp_path: Path) -> None:
    assert _validate(tmp_path, "spec:\n  model: {checkpoint: 'gs://bucket/qwen'}\n")[0] == 0
    tpu = "spec:\n  model: {checkpoint: /models/policy}\n  learner: {accelerator: tpu-v6e-slice, topology: 2x4}\n"
    code, err = _validate(tmp_path, tpu)
    assert code == 0, err


def test_stoker_run_refuses_a_missing_checkpoint_before_starting(tmp_path: Path) -> None:
    from stoker.runner.local import resolve_options
    from stoker.manifest import ManifestError

    path = tmp_path / "job.yaml"
    path.write_text(MINIMAL + "spec:\n  model: {checkpoint: /models/policy}\n  learner: {accelerator: tpu-v6e-slice, topology: 2x4}\n")
    args = argparse.Namespace(file=str(path), mode="async", run_dir=tmp_path / "run", max_minutes=None,
                              target_success=None, max_steps=None, no_progress=True)
    with pytest.raises(ManifestError, match="spec.model.checkpoint"):
        resolve_options(args)  # `stoker run` runs here, whatever the accelerator says
    assert not (tmp_path / "run").exists()


def test_the_actor_says_the_checkpoint_path_is_wrong_not_to_pick_a_tokenizer(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate({"model": {"checkpoint": str(tmp_path / "missing")}})
    with pytest.raises(TokenizerProblem, match="is not a directory") as error:
        environment_tokenizer(spec)
    assert "model.tokenizer" not in str(error.value)
