"""Who holds this host's TPU: found from /proc before JAX starts, and said plainly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stoker import chips


def _fake_host(tmp_path: Path, *, chip: bool, holder_maps: str) -> tuple[Path, Path]:
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir(parents=True)
    if chip:
        (dev / "accel0").write_text("")
    pid = proc / "4242"
    pid.mkdir(parents=True)
    (pid / "maps").write_text(holder_maps)
    (pid / "cmdline").write_bytes(b"python3\0-m\0stoker.cli\0learner\0")
    (proc / "self").mkdir()  # not a pid: skipped
    return dev, proc


def test_a_held_chip_names_the_holder_and_the_way_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    dev, proc = _fake_host(tmp_path, chip=True, holder_maps="7f00-7f10 r-xp 0 08:01 1 /usr/lib/python3/libtpu/libtpu.so\n")
    with pytest.raises(chips.ChipHeld, match=r"rollout: this host's TPU is held by pid 4242 \(python3 -m stoker.cli learner\).*JAX_PLATFORMS=cpu"):
        chips.check_free("rollout", proc=str(proc), dev=str(dev))


def test_no_error_without_a_chip_without_a_holder_or_pinned_to_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    dev, proc = _fake_host(tmp_path / "a", chip=False, holder_maps="libtpu.so\n")
    chips.check_free("learner", proc=str(proc), dev=str(dev))
    dev, proc = _fake_host(tmp_path / "b", chip=True, holder_maps="/usr/lib/libc.so.6\n")
    chips.check_free("learner", proc=str(proc), dev=str(dev))
    dev, proc = _fake_host(tmp_path / "c", chip=True, holder_maps="libtpu.so\n")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    chips.check_free("learner", proc=str(proc), dev=str(dev))


def test_a_real_process_with_libtpu_mapped_is_found(tmp_path: Path) -> None:
    fake = tmp_path / "libtpu.so"
    fake.write_bytes(b"\0" * 4096)
    code = f"import mmap,sys; f=open({str(fake)!r},'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); print('ok',flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        assert holder.pid in [h.pid for h in chips.holders()]
    finally:
        holder.kill()
        holder.wait()
