"""``stoker bench``: the job's programs, built as ``stoker plan`` builds them, run on this host's
devices (the CPU here) with random weights and full-length batches, and measured beside the plan's
figures for the same programs; a program the plan's check says cannot fit is reported, not run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest

from stoker.cli import main as cli

ROLLOUT = "  rollout: {maxBatch: 4}\n"


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli(["bench", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny_config() -> object:
    from stoker.spec import TransformerConfig

    return TransformerConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, max_seq_len=512)


def test_every_program_runs_on_the_cpu_and_is_measured_beside_the_plans_figures(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], xla_cache: Path
) -> None:
    code, out, err = bench(capsys, str(job(rollout=ROLLOUT)), "--repeats", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    host = result["host"]
    # The CPU publishes no peak flops and keeps no memory statistics: n/a, never a made-up figure.
    assert host["platform"] == "cpu" and host["chip"] is None and host["peak_flops_per_device"] is None
    assert host["memory_limit_bytes_per_device"] > 0 and "host RAM" in host["memory_limit_source"]
    rows = {r["program"]: r for r in result["programs"]}
    assert list(rows) == ["grad 128", "apply", "publish", "prefill", "decode"]
    assert [r["component"] for r in rows.values()] == ["learner"] * 3 + ["rollout"] * 2
    for name, r in rows.items():
        assert r["status"] == "ran" and r["reason"] is None, (name, r["reason"])
        assert 0 < r["seconds_min"] <= r["seconds"], name
        assert r["first_run_seconds"] > 0 and r["compile_seconds"] > 0 and r["repeats"] == 2 and r["devices"] == 1
        assert r["mfu"] is None and r["peak_bytes_per_device"] is None
        plan = r["plan"]
        assert plan["fits"] and plan["advice"] is None and plan["bound"] is None  # no peaks, no bound
        assert plan["total_bytes"] == sum(plan["terms"].values()) > 0
        assert plan["limit_bytes"] == host["memory_limit_bytes_per_device"]
    from stoker.model.flops import decode_flops, train_flops

    config = tiny_config()
    grad = rows["grad 128"]
    # 2 groups x 4 episodes, 4 rows of 128 per micro-batch (microbatchTokens 4 x the bucket).
    assert grad["shape"] == "4 x 128 tokens" and grad["tokens"] == 4 * 128
    assert math.isclose(grad["tokens_per_second"], 4 * 128 / grad["seconds"])
    assert grad["model_flops"] == train_flops(config, 4, 128)  # the plan's useful flops, for MFU
    assert {"parameters", "optimizer", "gradients", "batch", "temporaries"} <= set(grad["plan"]["terms"])
    decode = rows["decode"]  # one token for each of maxBatch rows over 128 cached slots
    assert decode["tokens"] == 4 and math.isclose(decode["tokens_per_second"], 4 / decode["seconds"])
    assert decode["model_flops"] == decode_flops(config, 4, 128)
    assert rows["prefill"]["tokens"] == 4 * 128 and "KV cache" in rows["prefill"]["plan"]["terms"]
    assert rows["apply"]["tokens"] is None and rows["apply"]["tokens_per_second"] is None
    assert result["fits"] and result["not_built"] == [] and not result["unfinished"]
    # A learner's cold first step: its grad and the apply, each compiled and run once.
    assert result["first_step_seconds"] == pytest.approx(sum(
        rows[p]["compile_seconds"] + rows[p]["first_run_seconds"] for p in ("grad 128", "apply")))

    from stoker.sizing.bench import render

    text = render(result)
    assert "peak flops unknown: MFU n/a" in text and "learner grad 128" in text and "DOES NOT FIT" not in text
    assert "time to a learner's first step: " in text


@pytest.mark.slow
def test_over_two_devices_the_learner_shards_over_fsdp_and_the_server_over_tp(
    job: Callable[..., Path], jax_env: dict[str, str], tmp_path: Path
) -> None:
    """Two CPU devices (a process of its own: the device count is fixed when JAX starts): the
    random weights, the batch and the cache are made in the programs' sharded layouts and run."""
    path = job(rollout="  rollout: {maxBatch: 4, tensorParallel: 2}\n")
    env = {**jax_env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "bench", str(path), "--json", "--repeats", "1",
                           "--programs", "grad,decode"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["host"]["devices"] == 2 and "shared by 2 devices" in result["host"]["memory_limit_source"]
    grad, decode = result["programs"]
    assert grad["status"] == decode["status"] == "ran" and grad["devices"] == decode["devices"] == 2
    assert grad["plan"]["notes"][0].startswith("fsdp 2 x tp 1") and decode["plan"]["notes"][0].startswith("tp 2")


def test_a_job_over_the_hosts_memory_is_not_run_but_reported_with_its_largest_term(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], xla_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2^24 x 2^13 embedding: 512 GiB of float32 parameters, over any test machine's RAM. Compiling
    # it allocates nothing; the plan's check stops it before any array is made (were it run
    # anyway, the test fails here rather than asking the host for 512 GiB).
    from stoker.sizing import bench as bench_module

    def never(program: object, repeats: int, phase: object = None) -> tuple[float, list[float]]:
        pytest.fail("a program the plan's check says cannot fit was run")

    monkeypatch.setattr(bench_module, "run", never)
    path = job(vocab=2**24, hidden=2**13, rollout=ROLLOUT)
    code, out, err = bench(capsys, str(path), "--programs", "publish,prefill", "--json")
    assert code == 1
    assert "Traceback" not in err
    result = json.loads(out)
    rows = {r["program"]: r for r in result["programs"]}
    assert list(rows) == ["publish", "prefill"]  # --programs: only those compiled
    assert not result["fits"]
    for r in rows.values():
        plan = r["plan"]
        assert r["status"] == "does not fit" and r["seconds"] is None and not plan["fits"]
        assert plan["total_bytes"] > plan["limit_bytes"]
        assert f"largest term {plan['largest']}" in r["reason"] and f"To fit: {plan['advice']}" in r["reason"]
    assert rows["prefill"]["plan"]["largest"] == "parameters"
    assert "rollout.tensorParallel" in rows["prefill"]["plan"]["advice"]
    assert rows["publish"]["plan"]["largest"] == "optimizer"  # Adam's two moments
    assert rows["publish"]["plan"]["advice"].startswith("learner.optimizerStateDtype: bfloat16")

    from stoker.sizing.bench import render

    text = render(result)
    assert "DOES NOT FIT: rollout prefill: " in text and "largest term parameters 512." in text


def test_on_a_device_with_published_peaks_mfu_and_the_bound_come_from_the_plans_flops(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], xla_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU taken for a v5e chip: MFU is the plan's useful flops over the measured seconds at
    197 TFLOP/s, the bound the plan's roofline for the same compiled program."""
    from stoker.sizing import bench as bench_module
    from stoker.sizing import chips

    monkeypatch.setattr(bench_module, "chip_of_device", lambda kind: chips.CHIPS["v5e"])
    code, out, err = bench(capsys, str(job(rollout=ROLLOUT)), "--programs", "decode", "--repeats", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["host"]["chip"] == "v5e" and result["host"]["peak_flops_per_device"] == 197e12
    # The CPU's memory_stats() is None: the limit is the chip's usable HBM.
    assert result["host"]["memory_limit_bytes_per_device"] == int(15.75 * 2**30)
    (decode,) = result["programs"]
    assert math.isclose(decode["mfu"], decode["model_flops"] / (decode["seconds"] * 197e12))
    bound = decode["plan"]["bound"]
    assert bound["seconds"] == max(bound["compute_seconds"], bound["memory_seconds"], bound["ici_seconds"])
    assert bound["compute_seconds"] >= decode["model_flops"] / 197e12
    # Beside the compiler's bound: the attainable rate, reading the weights once and each row's
    # cached context (4 rows x 128 slots) at the v5e's 819 GB/s, or the flops at peak.
    from stoker.model.layers import head_dim

    config = tiny_config()
    kv = 4 * 128 * (2 * config.num_layers * config.num_kv_heads * head_dim(config) * 4 + 4)  # float32 K, V; int32 segment
    assert decode["plan"]["terms"]["batch KV"] == kv
    must_read = decode["plan"]["terms"]["parameters"] + kv
    attainable = 4 / max(must_read / 819e9, decode["model_flops"] / 197e12)
    assert decode["attainable_tokens_per_second"] == pytest.approx(attainable)
    assert decode["share_of_attainable"] == pytest.approx(decode["tokens_per_second"] / attainable)

    from stoker.sizing.bench import render

    text = render(result)
    assert "peak 197 TFLOP/s each" in text and "-bound)" in text and "%" in text
    assert f"of the attainable {attainable:,.0f}" in text
    # A v5e has been measured: the plan's estimate beside its bound (sizing/calibration.py).
    from stoker.sizing.bound import Bound
    from stoker.sizing.calibration import V5E

    terms = Bound(bound["compute_seconds"], bound["memory_seconds"], bound["ici_seconds"], bound["dcn_seconds"])
    assert bound["estimate_seconds"] == pytest.approx(V5E.estimate(terms))
    assert "as measured" in text


def test_a_device_that_runs_out_of_memory_at_run_time_is_reported_not_raised(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str], xla_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jax

    from stoker.sizing import bench as bench_module

    def refused(program: object, repeats: int, phase: object = None) -> tuple[float, list[float]]:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")

    monkeypatch.setattr(bench_module, "run", refused)
    code, out, err = bench(capsys, str(job()), "--programs", "publish", "--json")
    assert code == 1 and "Traceback" not in err
    (publish,) = json.loads(out)["programs"]
    assert publish["status"] == "out of memory" and publish["plan"]["fits"]
    assert publish["reason"].startswith("RESOURCE_EXHAUSTED") and "largest planned term optimizer" in publish["reason"]


def test_a_mesh_the_hosts_devices_cannot_take_is_said_in_one_line(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = bench(capsys, str(job(learner=", mesh: {tp: 2}")), "--programs", "grad")
    assert code == 1 and "Traceback" not in err
    assert "NOT BUILT on these devices: learner: learner.mesh.tp=2 does not divide the 1 devices" in out


def test_an_unknown_program_is_refused_with_the_known_ones(
    job: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli(["bench", str(job()), "--programs", "grad,sample"])
    assert exit_.value.code == 2
    assert "sample: expected a comma-separated list of grad, apply, publish, prefill, decode" in capsys.readouterr().err


def test_loading_the_command_loads_no_jax_and_leaves_the_platform_to_the_host() -> None:
    """``stoker bench --help`` stays cheap, and importing the plan's fit check (``stoker.sizing.plan``)
    must not set JAX_PLATFORMS=cpu, as ``stoker plan`` does for itself: on a TPU host the bench
    would silently time the CPU."""
    probe = ("import os, sys; from stoker.cli import build_parser; build_parser(['bench']); "
             "print('jax' in sys.modules, os.environ.get('JAX_PLATFORMS'))")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None"]


def test_device_kinds_map_to_their_chips_and_the_cpu_to_none() -> None:
    from stoker.sizing.chips import CHIPS, chip_of_device

    assert chip_of_device("TPU v5 lite") == CHIPS["v5e"] and chip_of_device("TPU v6 lite") == CHIPS["v6e"]
    assert chip_of_device("TPU v5") == CHIPS["v5p"] and chip_of_device("TPU v4") == CHIPS["v4"]
    assert chip_of_device("cpu") is None


def test_a_program_that_never_finishes_is_reported_with_its_phase_and_nothing_after_it_runs(
    job: Callable[..., Path], xla_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The v5e's Adam update once sat in its first run for > 280 s while the bench waited: a
    program past ``--program-timeout`` is reported with where it was, never waited on forever."""
    import threading

    from stoker.manifest import load_job
    from stoker.sizing import bench as bench_module

    real_run, released = bench_module.run, threading.Event()

    def apply_hangs(program: object, repeats: int, phase: object = None) -> tuple[float, list[float]]:
        if getattr(program, "name") == "apply":
            phase.enter("first run")  # type: ignore[union-attr]
            released.wait()  # a device call that does not return (until the test ends)
            raise RuntimeError("released at the end of the test")
        return real_run(program, repeats, phase)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_module, "run", apply_hangs)
    heard: list[str] = []
    try:
        result = bench_module.bench(load_job(job()).spec, ("grad", "apply", "publish"), 1, heard.append, timeout=1.0)
    finally:
        released.set()
    rows = {r["program"]: r for r in result["programs"]}
    assert rows["apply"]["status"] == "did not finish" and rows["apply"]["seconds"] is None
    assert rows["apply"]["reason"].startswith("still in its first run after 1 s (--program-timeout 1)")
    # Programs run smallest plan first: those before the stuck apply ran, none after it started.
    stuck_at = rows["apply"]["plan"]["total_bytes"]
    after = [r for r in rows.values() if r["plan"]["total_bytes"] > stuck_at]
    assert after and all(r["status"] == "not run" and r["seconds"] is None for r in after)
    assert all(r["reason"] == "not run: learner apply did not finish before it" for r in after)
    assert all(r["status"] == "ran" for r in rows.values() if r["plan"]["total_bytes"] < stuck_at)
    assert result["unfinished"] and not result["fits"] and result["first_step_seconds"] is None
    assert "running learner apply (one Adam update) ..." in heard

    from stoker.sizing.bench import render

    assert "DID NOT FINISH: learner apply: still in its first run after 1 s" in render(result)


def test_the_command_exits_with_the_report_while_a_program_is_still_stuck(job: Callable[..., Path], tmp_path: Path) -> None:
    """A stuck device call must not keep the process alive either: the report is printed and
    ``stoker bench`` exits 3 at once, its stuck thread left behind."""
    script = (
        "import sys, threading\n"
        "from stoker.sizing import bench\n"
        "def stuck(program, repeats, phase=None):\n"
        "    phase.enter('first run')\n"
        "    threading.Event().wait()\n"  # never set: the process must leave without it
        "bench.run = stuck\n"
        "from stoker.cli import main\n"
        f"sys.exit(main(['bench', {str(job())!r}, '--programs', 'publish', '--program-timeout', '1', '--json']))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 3, done.stderr[-3000:]
    (publish,) = json.loads(done.stdout)["programs"]
    assert publish["status"] == "did not finish" and "first run after 1 s" in publish["reason"]


def test_the_bound_hears_progress_while_waiting_and_passes_results_and_errors_through() -> None:
    import threading

    from stoker.sizing.bench_watch import Phase, Unfinished, bounded

    heard: list[str] = []
    phase, release = Phase(), threading.Event()
    phase.enter("timed run 2 of 5")
    with pytest.raises(Unfinished) as stuck:
        bounded(release.wait, 0.3, "learner apply", phase, heard.append, heartbeat=0.05)
    release.set()
    assert (stuck.value.phase, stuck.value.bound) == ("timed run 2 of 5", 0.3) and stuck.value.seconds >= 0.3
    assert heard and all(line.startswith("  learner apply: timed run 2 of 5, still running after ") for line in heard)
    assert bounded(lambda: 42, 5.0, "x", Phase(), heard.append) == 42

    def fails() -> None:
        raise ValueError("from the device")

    with pytest.raises(ValueError, match="from the device"):
        bounded(fails, 5.0, "x", Phase(), heard.append)


def test_inputs_compile_one_small_program_per_distinct_leaf_layout_and_differ_between_leaves() -> None:
    """A model's ~300 leaves repeat a dozen layouts. One program over the whole tree took XLA
    minutes to compile on a TPU and the bench sat in "making inputs"; per layout it compiles a few
    small ones, and a deeper tree of the same layouts compiles nothing more."""
    import jax
    import numpy as np
    from jax import monitoring
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    from stoker.sizing.programs import _filler, random_like

    def layer(width: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"w": jax.ShapeDtypeStruct((width, 2 * width), np.float32), "b": jax.ShapeDtypeStruct((2 * width,), np.float32),
                "mask": jax.ShapeDtypeStruct((3,), np.bool_)}

    def compiles_to_make(tree: Any) -> tuple[Any, int]:
        where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)
        compiles: list[str] = []

        def heard(event: str, seconds: float, **_: object) -> None:
            if event == BACKEND_COMPILE_EVENT:
                compiles.append(event)

        monitoring.register_event_duration_secs_listener(heard)
        try:
            return random_like(tree, where, seed=7), len(compiles)
        finally:
            monitoring.unregister_event_duration_listener(heard)

    shallow = {f"layer_{i}": layer(8) for i in range(3)} | {"head": layer(16)}
    tree = {f"layer_{i}": layer(8) for i in range(40)} | {"head": layer(16)}
    _filler.cache_clear()
    _, first = compiles_to_make(shallow)
    made, deeper = compiles_to_make(tree)
    assert first <= 5 and deeper == 0  # one program per layout, made once: not one per tree, nor per leaf
    where = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), tree)
    first, second = np.asarray(made["layer_0"]["w"]), np.asarray(made["layer_1"]["w"])
    assert first.shape == (8, 16) and 0.01 < first.std() < 0.04
    assert not np.allclose(first, second)  # each leaf its own key
    assert np.asarray(made["layer_3"]["mask"]).all()
    assert not np.asarray(random_like(tree, where, seed=7, scale=0.0)["head"]["w"]).any()
