"""The teacher of on-policy distillation: a Hugging Face checkpoint that shares the student's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.conversation.tokenization import TokenizerProblem, environment_tokenizer
from stoker.hfconfig import CheckpointError
from stoker.model.hf import load_checkpoint
from stoker.model.tokenizer import TokenizerError, load_tokenizer
from stoker.spec import RLJobSpec


class TeacherError(ValueError):
    """A teacher the job cannot distill from (said in one line)."""


def tokenizer_problem(spec: RLJobSpec, teacher_dir: str, teacher_vocab_size: int, student_vocab_size: int) -> str | None:
    """Why the teacher's token ids are not the student's, or None. Distillation compares the two
    models' log-probs of the same ids, so the vocabularies must be the same mapping."""
    where = f"algorithm.teacher.checkpoint {teacher_dir}"
    path = Path(teacher_dir) / "tokenizer.json"
    if path.is_file():
        try:
            student = environment_tokenizer(spec).get_vocab(with_added_tokens=True)
            teacher = load_tokenizer(path).get_vocab(with_added_tokens=True)
        except (TokenizerProblem, TokenizerError) as exc:
            return f"{where}: {exc}"
        if teacher != student:
            differing = len(set(teacher.items()) ^ set(student.items()))
            return (
                f"{where}: its tokenizer differs from the student's ({len(teacher)} against {len(student)} tokens, "
                f"{differing} entries differ); the teacher must share the student's tokenizer"
            )
    if teacher_vocab_size != student_vocab_size:
        return (
            f"{where}: vocab_size {teacher_vocab_size}, the student's {student_vocab_size}; "
            "the teacher must share the student's tokenizer"
        )
    return None


def load_teacher(spec: RLJobSpec, checkpoint: str, dtype: Any, student_vocab_size: int) -> Any:
    """The teacher model (``stoker.model.hf.load_checkpoint``), refused with one line when its
    tokenizer is not the student's."""
    try:
        teacher = load_checkpoint(checkpoint, dtype=dtype)
    except (CheckpointError, OSError) as exc:
        raise TeacherError(f"algorithm.teacher.checkpoint {checkpoint}: {exc}") from None
    problem = tokenizer_problem(spec, checkpoint, teacher.config.vocab_size, student_vocab_size)
    if problem is not None:
        raise TeacherError(problem)
    return teacher
