"""The synchronous loop's time split as the report states it (``stoker.runner.phases``): shares of
the wall time, tokens/s and MFU per phase from the steps after the first, against the equations."""

from __future__ import annotations

from pathlib import Path

from stoker.runner import phases

V5E_PEAK = 197e12


def _step(step: int, **kw: float) -> phases.StepPhases:
    figures = dict(wall_seconds=2.0, generate_seconds=1.0, play_seconds=1.2, train_seconds=0.6, weights_seconds=0.2,
                   sampled_tokens=1000.0, prefilled_tokens=3000.0, trained_tokens=8000.0)
    figures.update(kw)
    return phases.StepPhases(step=step, matmul_params=10**9, device_kind="TPU v5 lite", devices=1, **figures)


def test_the_split_leaves_out_the_first_step_and_gives_each_phases_mfu(tmp_path: Path) -> None:
    phases.append(tmp_path, _step(1, wall_seconds=60.0, generate_seconds=30.0))  # compiles: left out
    phases.append(tmp_path, _step(2))
    phases.append(tmp_path, _step(3, generate_seconds=0.5, play_seconds=0.7, wall_seconds=1.5))
    text = "\n".join(phases.report_lines(tmp_path))
    assert "(2 steps after the first; 1 TPU v5 lite device(s))" in text
    # Generating: 1.5 s of 3.5 s; 2000 sampled and 6000 prefilled tokens; 2 x 1e9 flops a token.
    gen_mfu = 100 * 2 * 1e9 * 8000 / (1.5 * V5E_PEAK)
    assert f"| generating (the sampler's calls) | 43 % | 1,333 sampled, 4,000 prefilled | {gen_mfu:.1f} % |" in text
    assert "| the rest of playing (environments, tokenizing) | 11 % | - | - |" in text  # (1.9 - 1.5) / 3.5
    train_mfu = 100 * 6 * 1e9 * 16000 / (1.2 * V5E_PEAK)
    assert f"| training | 34 % | 13,333 trained | {train_mfu:.1f} % |" in text
    assert "| new weights to the sampler | 11 % | - | - |" in text
    assert "A step took 1.75 s on average." in text


def test_a_cpu_run_has_no_mfu_and_one_step_no_section(tmp_path: Path) -> None:
    phases.append(tmp_path, _step(1))
    assert phases.report_lines(tmp_path) == []
    phases.append(tmp_path, phases.StepPhases(**{**_step(2).__dict__, "device_kind": "cpu"}))
    text = "\n".join(phases.report_lines(tmp_path))
    assert "no published peak: no MFU" in text and "| training | 30 % | 13,333 trained | - |" in text


def test_a_step_that_compiled_is_left_out_and_said(tmp_path: Path) -> None:
    """A sampler program compiled mid-run for a shape the run had not met (36 s of a 37 s step on
    the chip) would make the steady state's table mostly "generating"."""
    phases.append(tmp_path, _step(1, wall_seconds=60.0, compile_seconds=50.0))
    phases.append(tmp_path, _step(2, compile_seconds=0.15))  # a small program: under a tenth of the step, kept
    phases.append(tmp_path, _step(3, wall_seconds=37.0, generate_seconds=36.0, play_seconds=36.2, compile_seconds=35.0))
    phases.append(tmp_path, _step(4))
    text = "\n".join(phases.report_lines(tmp_path))
    assert "(2 steps after the first; 1 that compiled left out, 37.0 s; 1 TPU v5 lite device(s))" in text
    assert "| generating (the sampler's calls) | 50 % |" in text  # steps 2 and 4: 2 s of 4
    assert "A step took 2.00 s on average." in text


def test_when_every_step_compiled_the_table_keeps_them(tmp_path: Path) -> None:
    phases.append(tmp_path, _step(1, compile_seconds=1.5))
    phases.append(tmp_path, _step(2, compile_seconds=1.5))
    assert "(1 steps after the first; 1 TPU v5 lite device(s))" in "\n".join(phases.report_lines(tmp_path))
