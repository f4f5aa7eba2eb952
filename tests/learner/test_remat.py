"""``model.remat: auto``: the first of none, save-matmuls, full whose step fits the device with
``HEADROOM`` free (the pure rule), none on the CPU without compiling, and the learner's own
decision on an accelerator from its compiled steps. The rule on libtpu's programs for v5e and v5p
slices: tests/sizing/test_remat_plan.py."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from stoker.learner import remat, sharding, train
from stoker.model.model import RematPolicy, Transformer
from stoker.spec import ModelSpec, TransformerConfig

MIB = 2**20


def peaks(table: dict[str, int | None]) -> tuple[list[str], Any]:
    """A peak function over ``table`` that records what it was asked (each call is a compile)."""
    asked: list[str] = []

    def peak(policy: RematPolicy) -> int | None:
        asked.append(policy)
        return table[policy]

    return asked, peak


def test_the_first_policy_within_the_limit_less_headroom_is_chosen_and_no_more_are_compiled() -> None:
    table: dict[str, int | None] = {"none": 95 * MIB, "save-matmuls": 80 * MIB, "full": 50 * MIB}
    asked, peak = peaks(table)
    # 100 MiB less 10 %: 90 MiB allowed. none (95) is over, save-matmuls (80) fits: full never compiles.
    choice = remat.choose_remat(peak, 100 * MIB)
    assert (choice.policy, asked) == ("save-matmuls", ["none", "save-matmuls"])
    assert choice.line == "remat auto: save-matmuls (peak 80.00 MiB of 100.00 MiB, headroom 10%)"
    assert dict(choice.peaks) == {"none": 95 * MIB, "save-matmuls": 80 * MIB}

    asked, peak = peaks(table)
    assert remat.choose_remat(peak, 200 * MIB).policy == "none" and asked == ["none"]

    # Only full fits.
    table["save-matmuls"] = 92 * MIB
    asked, peak = peaks(table)
    assert remat.choose_remat(peak, 100 * MIB).policy == "full" and asked == ["none", "save-matmuls", "full"]


def test_the_headroom_is_kept_at_its_boundary() -> None:
    limit = 100 * MIB
    allowed = remat.budget(limit)
    assert allowed == int(limit * (1 - remat.HEADROOM)) < limit
    for needed, policy in ((allowed, "none"), (allowed + 1, "full")):
        _, peak = peaks({"none": needed, "save-matmuls": needed, "full": 1})
        assert remat.choose_remat(peak, limit).policy == policy
    # No headroom: the whole limit.
    _, peak = peaks({"none": limit, "save-matmuls": 1, "full": 1})
    assert remat.choose_remat(peak, limit, headroom=0.0).policy == "none"


def test_a_policy_the_compiler_refuses_never_fits_and_when_nothing_fits_the_least_is_taken() -> None:
    _, peak = peaks({"none": None, "save-matmuls": 70 * MIB, "full": 60 * MIB})
    assert remat.choose_remat(peak, 100 * MIB).policy == "save-matmuls"
    # Over the limit everywhere: the policy that needs the least, whichever it is, and why.
    _, peak = peaks({"none": None, "save-matmuls": 120 * MIB, "full": 130 * MIB})
    choice = remat.choose_remat(peak, 100 * MIB)
    assert choice.policy == "save-matmuls"
    assert "nothing fits 90.00 MiB" in choice.reason and "none refused by the compiler" in choice.reason
    assert "save-matmuls needs the least" in choice.reason
    _, peak = peaks({"none": None, "save-matmuls": None, "full": None})
    assert remat.choose_remat(peak, 100 * MIB).policy == "full"


def test_a_set_policy_is_kept_and_auto_on_the_cpu_is_none_without_compiling() -> None:
    asked, peak = peaks({"none": 1, "save-matmuls": 1, "full": 1})
    assert remat.resolve_remat("save-matmuls", "tpu", peak, 100).policy == "save-matmuls"
    cpu = remat.resolve_remat("auto", "cpu", peak, None)
    assert cpu.policy == "none" and "CPU" in cpu.reason
    assert remat.resolve_remat("auto", "gpu", peak, None).policy == "full"  # no limit known: the least memory
    assert asked == []


def test_auto_is_the_default_and_its_description_states_the_headroom() -> None:
    field = ModelSpec.model_fields["remat"]
    assert ModelSpec().remat == "auto"
    assert f"{remat.HEADROOM:.0%}" in (field.description or "")


CONFIG = TransformerConfig(vocab_size=16, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                           intermediate_size=32, max_seq_len=64)


@pytest.mark.slow
def test_on_an_accelerator_the_learner_compiles_each_policy_until_one_fits_its_device() -> None:
    """The learner's own path (``learner_remat``): a device that says it is a TPU with a byte limit,
    the steps compiled by abstract trainers on this host's CPU (nothing allocated)."""
    mesh = sharding.make_mesh()
    model = nnx.eval_shape(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)))
    built: list[str] = []

    def build(policy: RematPolicy) -> train.Trainer:
        built.append(policy)
        return train.Trainer(model, train.StepOptions(remat=policy), optax.adam(1e-3), mesh)

    def device(limit: int) -> Any:
        stats = {"bytes_limit": limit}
        return SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu", memory_stats=lambda: stats)]))

    roomy = remat.learner_remat("auto", device(2**40), {16: 2}, build, workers=0)
    needed = roomy.peaks["none"]
    assert roomy.policy == "none" and built == ["none"] and needed is not None and needed > 0
    assert roomy.reason.startswith("peak ") and "of 1024.00 GiB" in roomy.reason
    built.clear()
    # Two buckets, the longest compiled first: over the limit already, the shorter is not compiled.
    compiled: list[int] = []
    programs = train.Trainer.programs

    def counted(self: train.Trainer, rows: int, length: int) -> Any:
        compiled.append(length)
        return programs(self, rows, length)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train.Trainer, "programs", counted)
        tight = remat.learner_remat("auto", device(needed // 4), {16: 2, 32: 1}, build, workers=0)
    assert built == ["none", "save-matmuls", "full"] and compiled == [32, 32, 32] and "nothing fits" in tight.reason
    built.clear()
    assert remat.learner_remat("full", device(needed // 4), {16: 2}, build).policy == "full" and built == []
    built.clear()

    # On a host with the cores (a TPU VM), every candidate's longest bucket compiles at once: each
    # compile waits at a barrier for the other two, which a compile in turn would never reach.
    barrier = threading.Barrier(len(remat.REMAT_ORDER), timeout=60)
    compile_lowered = jax.stages.Lowered.compile
    threads: list[str] = []

    def together(self: Any, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        barrier.wait()
        return compile_lowered(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax.stages.Lowered, "compile", together)
        side_by_side = remat.learner_remat("auto", device(2**40), {16: 2}, build, workers=4)
    assert side_by_side.policy == "none" and side_by_side.peaks["none"] == needed
    assert built == list(remat.REMAT_ORDER) and len(threads) == 3 and all(t.startswith("remat") for t in threads)
    assert remat.side_by_side_workers(2) == 0 and remat.side_by_side_workers(13) == len(remat.REMAT_ORDER) + 1


def test_the_learner_on_the_cpu_says_its_choice_and_trains_with_it(caplog: pytest.LogCaptureFixture) -> None:
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.learner.testing import tiny_spec

    def learner(setting: str) -> Learner:
        spec = tiny_spec(model={"remat": setting}, learner={"sequenceBuckets": [16], "microbatchTokens": 32})
        return Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None), resume=False)

    with caplog.at_level(logging.INFO, logger="stoker.learner.loop"):
        auto = learner("auto")
    assert auto.trainer.options.remat == "none" and auto.remat.policy == "none"
    assert any(r.getMessage().startswith("remat auto: none (on the CPU") for r in caplog.records)
    assert learner("save-matmuls").trainer.options.remat == "save-matmuls"
