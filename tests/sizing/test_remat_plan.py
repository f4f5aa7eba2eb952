"""``model.remat: auto`` judged on libtpu's own programs for v5e and v5p slices (no TPU needed): the
first of none, save-matmuls, full whose grad step fits the chip with the headroom free. A small
model, and chips made as small as the choice needs, so each compile takes seconds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.learner.remat import HEADROOM, REMAT_ORDER, budget, side_by_side_workers
from stoker.manifest import load_job
from stoker.sizing.compiler import load_slice
from stoker.sizing import programs
from stoker.sizing.programs import learner_programs

pytestmark = pytest.mark.slow


MB = 10**6


# libtpu 0.0.42.1 lays this job's step out as (bytes per chip) v5e:2x2: none 10.40 MB, save-matmuls
# 8.34 MB, full 8.92 MB; v5p:2x2x1: none 17.72 MB, save-matmuls 19.53 MB, full 14.97 MB. So a v5e
# chip of 10.5 MB (9.45 MB less the headroom) takes save-matmuls, a v5p chip of 18 MB (16.2 MB) full.
@pytest.mark.parametrize(("topology", "limit", "expected"),
                         [("v5e:2x2", 10.5 * MB, "save-matmuls"), ("v5p:2x2x1", 18 * MB, "full")])
def test_auto_takes_the_first_policy_whose_step_fits_the_chip_less_the_headroom(
    topology: str, limit: float, expected: str, job: Callable[..., Path]
) -> None:
    spec = load_job(str(job(hidden=128, layers=3, mlp=384, bucket=256))).spec
    assert spec.model.remat == "auto"  # the default
    # The limits are sized for 4 x 256-token micro-batches, not a tiny model's whole batch.
    spec = spec.model_copy(update={"learner": spec.learner.model_copy(update={"microbatch_tokens": 1024})})
    (grad,) = learner_programs(spec, load_slice(topology, 4), kinds={"grad"}, memory_limit=int(limit))
    choice = grad.remat
    assert choice is not None
    peaks = dict(choice.peaks)
    earlier = list(REMAT_ORDER[:REMAT_ORDER.index(choice.policy)])
    # Each policy before the choice was compiled and is over the limit less the headroom; the choice
    # is within it, and nothing after it was compiled.
    assert list(peaks) == [*earlier, choice.policy]
    allowed = budget(int(limit))
    assert all(peaks[p] is None or peaks[p] > allowed for p in earlier)  # type: ignore[operator]
    assert grad.total == peaks[choice.policy] <= allowed
    assert choice.policy == expected, f"libtpu's layouts moved: {peaks}"
    assert f"remat {expected}" in grad.notes[0] and grad.notes[1] == choice.line
    assert choice.line.startswith(f"remat auto: {expected} (peak ") and f"headroom {HEADROOM:.0%}" in choice.line


def test_candidates_compiled_side_by_side_choose_and_lay_out_as_in_turn(
    job: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host with the cores, auto's candidates and the apply compile on threads at once
    (a TPU host's ~15-30 s each, side by side): the choice, the grad's terms and the apply's must be
    what the compiles one after another give."""
    spec = load_job(str(job(hidden=128, layers=3, mlp=384, bucket=256))).spec
    limit = int(10.5 * MB)
    in_turn = learner_programs(spec, load_slice("v5e:2x2", 4), kinds={"grad", "apply"}, memory_limit=limit,
                               compile_workers=0)
    lines: list[str] = []
    in_turn_compiles: list[str] = []
    real_compile = programs.compile_program

    def counted(*args: object, **kwargs: object) -> object:
        in_turn_compiles.append("compiled")
        return real_compile(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(programs, "compile_program", counted)
    side_by_side = learner_programs(spec, load_slice("v5e:2x2", 4), kinds={"grad", "apply"}, memory_limit=limit,
                                    compile_workers=4, progress=lines.append)
    assert any("side by side (4 threads)" in line for line in lines)
    assert in_turn_compiles == []  # what was compiled ahead is what is used: nothing compiled again
    assert [p.name for p in side_by_side] == [p.name for p in in_turn] == ["grad 256", "apply"]
    for alone, together in zip(in_turn, side_by_side, strict=True):
        assert together.terms == alone.terms and together.remat == alone.remat
    assert side_by_side[0].remat is not None and side_by_side[0].remat.policy == "save-matmuls"


def test_side_by_side_only_where_the_host_has_the_cores() -> None:
    assert side_by_side_workers(2) == 0  # CI's VM: one after another, stopping at the first fit
    assert side_by_side_workers(13) == len(REMAT_ORDER) + 1
