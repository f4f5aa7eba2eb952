"""stoker run --profile: each process samples its threads' stacks and says where its wall time goes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from stoker import profile
from stoker.profile import PROFILE_ENV, StackSampler, thread_family
from stoker.runner.local import child_env
from stoker.runner.options import RunOptions

REPO = Path(__file__).resolve().parents[2]


def spin_here(inside: threading.Event, done: threading.Event) -> None:
    inside.set()
    while not done.is_set():
        pass


def test_samples_name_the_function_each_thread_is_in_and_the_wait_a_blocked_one_sits_in(tmp_path: Path) -> None:
    inside, done, never = threading.Event(), threading.Event(), threading.Event()
    busy = threading.Thread(target=spin_here, args=(inside, done), name="busy-7")
    waiter = threading.Thread(target=lambda: never.wait(30), name="waiter_2")
    busy.start()
    waiter.start()
    try:
        inside.wait(10)
        sampler = StackSampler(tmp_path / "p" / "x.txt", "title line")
        # By hand from another thread: no timing in the test, every sample sees the main thread
        # (joining) and both threads where they are.
        sampling = threading.Thread(target=lambda: [sampler.sample() for _ in range(20)])
        sampling.start()
        sampling.join()
    finally:
        done.set()
        never.set()
        busy.join()
        waiter.join()
    text = sampler.summary()
    assert text.startswith("title line\n20 samples")
    busy_part = text.split("## busy: 20 samples")[1].split("##")[0]
    assert "test_profile.py:spin_here" in busy_part.splitlines()[1]  # the busy thread's top stack, innermost first
    assert "100.0 %" in busy_part
    waiter_part = text.split("## waiter: 20 samples")[1].split("##")[0]
    assert "threading.py:wait" in waiter_part
    assert text.index("## MainThread") < text.index("## busy")  # the main thread leads
    sampler.write()
    assert (tmp_path / "p" / "x.txt").read_text() == sampler.summary()


def test_a_stack_that_cannot_be_read_is_skipped_and_sampling_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On the v5e host (Python 3.11) an actor's profiler thread died on another thread's frame
    # torn down mid-walk ("'dict' object has no attribute 'f_code'"); sampling must outlive that.
    real = profile.stack_key
    calls = [0]

    def flaky(frame: Any, depth: int = profile.DEPTH) -> str:
        calls[0] += 1
        if calls[0] == 1:
            raise AttributeError("'dict' object has no attribute 'f_code'")
        return real(frame, depth)

    monkeypatch.setattr(profile, "stack_key", flaky)
    sampler = StackSampler(tmp_path / "x.txt", "title")
    sampling = threading.Thread(target=lambda: [sampler.sample() for _ in range(3)])
    sampling.start()
    sampling.join()
    assert sampler.samples == 3 and sampler.errors == 1
    assert sum(sampler.counts.values()) == calls[0] - 1  # every other stack was counted
    assert "## MainThread" in sampler.summary()


def test_thread_pools_add_up_under_one_family() -> None:
    assert thread_family("asyncio_3") == "asyncio"
    assert thread_family("ThreadPoolExecutor-0_1") == "ThreadPoolExecutor-0"
    assert thread_family("Thread-7 (_run)") == "Thread (_run)"
    assert thread_family("MainThread") == "MainThread"
    assert thread_family("buffer-rpc") == "buffer-rpc"


def test_a_stoker_process_started_with_the_variable_writes_its_profile_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, PROFILE_ENV: str(tmp_path / "profiles")}
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "validate", str(REPO / "examples" / "frozenlake.yaml")],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (written,) = (tmp_path / "profiles").glob("validate-*.txt")
    assert written.read_text().startswith(f"stoker validate (pid {written.stem.split('-')[1]}): ")
    assert "samples every 10 ms" in written.read_text()  # a run this short may end before the first sample


def test_run_profile_names_the_folder_for_every_child_and_only_then(tmp_path: Path) -> None:
    from stoker.manifest import load_job

    manifest = REPO / "examples" / "frozenlake.yaml"
    options = RunOptions(manifest=manifest, job=load_job(manifest), mode="async", run_dir=tmp_path / "run")
    assert PROFILE_ENV not in child_env(options) or os.environ.get(PROFILE_ENV)
    options.profile = True
    assert child_env(options)[PROFILE_ENV] == str(tmp_path / "run" / "profiles")
