"""``stoker plan``: the job's programs compiled by the real TPU compiler (libtpu) for a named slice,
per-chip memory against HBM, the verdict and its exit status, and the speed bound's arithmetic."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.cli import main as cli

GIB = 2**30


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_a_tiny_job_compiles_for_v5e_fits_and_reports_its_terms(job: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan(capsys, str(job()), "--topology", "v5e:2x2", "--json")
    assert code == 0
    result = json.loads(out)
    programs = {p["program"]: p for p in result["programs"]}
    assert list(programs) == ["grad 128", "apply", "publish"]
    assert result["fits"] and all(p["fits"] for p in programs.values())
    # vocab 256 x hidden 64 tied embedding + one block: float32 master weights, sharded over 4 chips.
    from stoker.spec import TransformerConfig

    config = TransformerConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                               intermediate_size=128, max_seq_len=512)
    from flax import nnx

    from stoker.model.model import Transformer, count_params

    total = 4 * count_params(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    grad = programs["grad 128"]
    # Only the embedding (256 x 64 = 2^14 values) is large enough to shard (4 ways over fsdp);
    # the block's matrices and norms stay replicated (learner/sharding.py, MIN_SHARDED_SIZE).
    embedding = 4 * 256 * 64
    assert grad["terms"]["parameters"] == total - embedding + embedding // 4
    # Adam's two moments, plus its step count(s).
    assert 0 <= grad["terms"]["optimizer"] - 2 * grad["terms"]["parameters"] <= 64
    assert grad["terms"]["gradients"] == 2 * grad["terms"]["parameters"]  # the sum so far + this micro-batch's
    # The last publish's copy (float32 compute here: the parameters' size) lives beside the step.
    assert grad["terms"]["publish copy"] == grad["terms"]["parameters"]
    assert grad["total_bytes"] == sum(grad["terms"].values())
    assert grad["hbm_bytes"] == 16 * GIB and grad["topology"] == "v5e:2x2"
    assert "attention splash" in grad["notes"][0]  # auto on a TPU
    # remat auto (the default): this step fits a v5e without remat, so none, compiled alone.
    assert "remat none" in grad["notes"][0] and grad["notes"][1].startswith("remat auto: none (peak ")
    remat = result["learner"]["remat"]
    assert (remat["setting"], remat["policy"]) == ("auto", "none") and remat["peak_bytes"] == {"none": grad["total_bytes"]}
    assert grad["flops"] > 0 and grad["bytes_accessed"] > 0
    # fsdp over 4 chips: the step gathers parameters and reduce-scatters gradients over ICI.
    assert grad["collective_bytes"]["ici"] > 0 and grad["collective_bytes"]["dcn"] == 0
    bound = grad["bound"]
    assert bound["seconds"] == max(bound["compute_seconds"], bound["memory_seconds"], bound["ici_seconds"])
    # libtpu counts a loop body once, so compute takes at least the useful flops' share per chip.
    assert math.isclose(bound["compute_seconds"], max(grad["flops"], grad["model_flops"] / 4) / 197e12)
    assert math.isclose(bound["memory_seconds"], grad["bytes_accessed"] / 819e9)
    learner = result["learner"]
    # 2 groups x 4 episodes of 128: on a TPU a model this small takes the whole batch (8 rows of
    # 128) in one micro-batch (packing.microbatch_tokens), not 4 x 128 tokens as on the CPU.
    assert learner["micro_batches"] == 1
    expected = bound["seconds"] + programs["apply"]["bound"]["seconds"] + programs["publish"]["bound"]["seconds"]
    assert math.isclose(learner["step_seconds_bound"], expected)
    assert 0 < learner["mfu_bound"] < 1
    assert "not measurements" in result["bound_note"]
    # A v5e has been measured: each program's estimate is its bound at the measured shares, and the
    # step's is the bound's sum over those estimates.
    from stoker.sizing.bound import Bound
    from stoker.sizing.calibration import V5E

    for p in programs.values():
        b = p["bound"]
        estimate = V5E.estimate(Bound(b["compute_seconds"], b["memory_seconds"], b["ici_seconds"], b["dcn_seconds"]))
        assert p["estimate_seconds"] == pytest.approx(estimate) and estimate >= b["seconds"] * 0.9
    estimated = grad["estimate_seconds"] + programs["apply"]["estimate_seconds"] + programs["publish"]["estimate_seconds"]
    assert learner["step_seconds_estimate"] == pytest.approx(estimated)
    assert learner["mfu_estimate"] == pytest.approx(learner["mfu_bound"] * learner["step_seconds_bound"] / estimated)


@pytest.mark.slow
def test_the_text_report_says_ok_and_that_the_figures_are_bounds(job: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, str(job()), "--topology", "v5e:2x2")
    assert code == 0
    assert "learner on TPU v5e:2x2: 4 chips of 16.00 GiB HBM" in out
    assert "note: remat auto: none (peak " in out and "of 15.75 GiB, headroom 10%)" in out  # the choice and why
    assert out.count(" OK ") == 3 and "DOES NOT FIT" not in out
    assert "MFU <=" in out and "not measurements" in out
    assert out.count(" as measured, compiled in ") == 3 and "step ~" in out and "sizing/calibration.py" in out
    assert "compiling the learner's programs for v5e:2x2" in err  # progress on stderr


@pytest.mark.slow
def test_a_job_over_the_chips_hbm_does_not_fit_exits_1_and_names_its_largest_term(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real big model on one chip compiles for minutes here (a 1.1B-parameter one took 290 s), so
    # the chip shrinks instead: the same tiny programs against a v5e with 2.5 MiB of HBM, where
    # 8 x 128-token micro-batches' temporaries are the largest term (2.84 MiB in all under remat
    # none, this one-layer step's least).
    import dataclasses

    from stoker.sizing import chips

    hbm = 5 * 2**19
    monkeypatch.setitem(chips.CHIPS, "v5e", dataclasses.replace(chips.CHIPS["v5e"], usable_hbm_bytes=hbm))
    code, out, _ = plan(capsys, str(job(learner=", microbatchTokens: 1024")), "--topology", "v5e:2x2", "--json")
    assert code == 1
    result = json.loads(out)
    grad = next(p for p in result["programs"] if p["program"] == "grad 128")
    assert not result["fits"] and not grad["fits"]
    assert grad["largest"] == "temporaries" and grad["terms"]["temporaries"] == max(grad["terms"].values())
    assert grad["total_bytes"] > hbm
    assert "learner.microbatchTokens, now 1024" in grad["advice"] and "8 x 128 tokens" in grad["advice"]
    # float32 compute is named first; sequence sharding is not, with tp = 1 (nothing to split over);
    # nor remat: auto compiled every policy and none fits, so it took the least and says so.
    assert grad["advice"].startswith("model.dtype: bfloat16") and "sequenceSharding" not in grad["advice"]
    assert "model.remat" not in grad["advice"]
    assert "nothing fits" in result["learner"]["remat"]["reason"]
    assert list(result["learner"]["remat"]["peak_bytes"]) == ["none", "save-matmuls", "full"]
    # A program under the shrunken HBM still fits: the verdict is per program.
    publish = next(p for p in result["programs"] if p["program"] == "publish")
    assert publish["fits"] and publish["total_bytes"] <= hbm


def test_a_gpu_rollout_tier_is_said_to_be_out_of_reach_and_a_cpu_learner_needs_a_topology(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = job(rollout="  rollout: {accelerator: nvidia-gpu, gpus: 1}\n")
    code, out, _ = plan(capsys, str(path))
    assert code == 0
    assert "rollout servers on nvidia-gpu: not compiled" in out and "needs a CUDA device" in out
    assert "learner: accelerator cpu, nothing to compile" in out and "--topology" in out


def test_without_libtpu_it_says_in_one_line_how_to_install_it(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu raises ImportError
    code, out, err = plan(capsys, str(job()), "--topology", "v5e:2x2")
    assert code == 3
    assert err.strip().splitlines()[-1] == "stoker plan: the TPU compiler (libtpu) is not installed: pip install 'stoker[tpu]'"


@pytest.mark.parametrize("name", ["v5e:3x3", "v9:2x2", "v5e"])
def test_a_topology_libtpu_or_gke_lacks_is_refused_in_one_line(
    name: str, job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = plan(capsys, str(job()), "--topology", name)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "stoker plan:" in err


def test_a_program_the_compiler_refuses_for_hbm_is_reported_with_its_temporaries() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from stoker.sizing.compiler import compile_program, load_slice

    devices = list(load_slice("v5e:2x2", 4).devices)
    whole = NamedSharding(Mesh(np.asarray(devices), ("x",)), PartitionSpec())

    def outer_sorted(x: jax.Array) -> jax.Array:  # an 80,000^2 float32 square (23.8 GiB) on every chip
        return jnp.sort(jnp.outer(x, x), axis=1)[:, :4]

    jitted = jax.jit(outer_sorted, in_shardings=(whole,), out_shardings=whole)
    compiled = compile_program(jitted, (jax.ShapeDtypeStruct((80000,), jnp.float32),), devices, lambda i: 0)
    assert compiled.error is not None and "exceeds available HBM (15.75G)" in compiled.error
    assert compiled.required_temp_bytes is not None and compiled.required_temp_bytes >= 80000**2 * 4


def _state_bound_grad(terms: dict[str, int]) -> tuple[object, object]:
    from stoker.sizing.chips import chip
    from stoker.sizing.compiler import Compiled
    from stoker.sizing.plan import Target
    from stoker.sizing.programs import Program

    program = Program("learner", "grad 8192", "1 x 8192 tokens", terms, Compiled(seconds=0.0))
    return program, Target("learner", "v6e:4x4", chip("v6e"), 16, 1)


@pytest.mark.parametrize(
    ("largest", "first"),
    [("optimizer", "learner.optimizerStateDtype: bfloat16"), ("parameters", "learner.weightDtype: bfloat16")],
)
def test_state_bound_advice_names_the_stored_dtype_of_the_largest_term_first(largest: str, first: str) -> None:
    """Over HBM because of sharded state: the float32 stored dtypes come before more chips, the
    largest term's first, each with what it saves; a knob already at bfloat16, or one the spec
    would refuse (LoRA, a fine-tuning learning rate), is not named."""
    from stoker.sizing.plan import advice
    from stoker.spec import RLJobSpec

    state = {"optimizer": 40 * GIB, "parameters": 10 * GIB, "gradients": 20 * GIB} if largest == "optimizer" else \
        {"parameters": 24 * GIB, "optimizer": 12 * GIB, "gradients": 16 * GIB}  # bf16 Adam state already: 0.5 x params
    program, target = _state_bound_grad({**state, "temporaries": 2 * GIB})
    assert program.largest == largest
    per_chip = program.total
    spec = RLJobSpec.model_validate({"algorithm": {"learningRate": 1e-4}})
    text = advice(program, target, spec, per_chip)
    knobs = text.split("; ")
    assert knobs[0].startswith(first), text
    assert knobs[2].startswith("more chips"), text  # after both stored dtypes
    if largest == "optimizer":
        assert "20.00 GiB less per chip" in knobs[0] and "15.00 GiB less per chip" in knobs[1]
    stored = RLJobSpec.model_validate({"learner": {"optimizerStateDtype": "bfloat16"}, "algorithm": {"learningRate": 1e-4}})
    assert "optimizerStateDtype" not in advice(program, target, stored, per_chip)
    for refused in ({"model": {"lora": {"rank": 4}}}, {"algorithm": {"learningRate": 1e-6}}):
        text = advice(program, target, RLJobSpec.model_validate(refused), per_chip)
        assert "weightDtype" not in text and "optimizerStateDtype" in text


@pytest.mark.slow
def test_bfloat16_weights_and_adam_state_halve_the_learners_state_terms(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny job of the first test compiled for v5e:2x2 with learner.weightDtype and
    optimizerStateDtype bfloat16: parameters and gradients half the float32 figure, the optimizer
    state half too (the moments in 2 bytes instead of 4), the publish copy still float32 (the
    compute dtype); the apply program, which casts to float32 and back, compiles and fits."""
    path = job(learner=", weightDtype: bfloat16, optimizerStateDtype: bfloat16")
    code, out, _ = plan(capsys, str(path), "--topology", "v5e:2x2", "--json")
    assert code == 0
    result = json.loads(out)
    programs = {p["program"]: p for p in result["programs"]}
    from flax import nnx

    from stoker.model.model import Transformer, count_params
    from stoker.spec import TransformerConfig

    config = TransformerConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                               intermediate_size=128, max_seq_len=512)
    values = count_params(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    embedding = 256 * 64  # sharded 4 ways over fsdp; the rest replicated (as in the float32 test)
    float32_params = 4 * (values - embedding + embedding // 4)
    grad = programs["grad 128"]
    assert grad["terms"]["parameters"] == float32_params // 2
    assert grad["terms"]["gradients"] == float32_params
    # float32: 2 x params (+ the step count); bfloat16 moments: half of that.
    assert 0 <= grad["terms"]["optimizer"] - float32_params <= 64
    assert grad["terms"]["publish copy"] == float32_params
    assert "weights bfloat16, Adam state bfloat16" in grad["notes"][0]
    apply = programs["apply"]
    assert apply["fits"] and apply["terms"]["optimizer"] == grad["terms"]["optimizer"]
