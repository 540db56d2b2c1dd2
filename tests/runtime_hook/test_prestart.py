"""prestart failure paths that need no container: pid gone, full disk, missing config.json; the bounded log."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from runtime_hook import hooklog, oci, prestart
from tests.support import hook as support
from vgpu.log import kv

pytestmark = pytest.mark.timeout(60)


def _decision(tmp: Path, token: str, pid: int) -> oci.Proceed:
    bundle = tmp / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "config.json").write_text(
        json.dumps({"root": {"path": "rootfs"}, "process": {"env": [f"{oci.TOKEN_ENV}={token}"]}})
    )
    state = json.dumps({"id": "c1", "pid": pid, "bundle": str(bundle)}).encode()
    d = oci.decide_prestart(state)
    assert isinstance(d, oci.Proceed)
    return d


def test_container_pid_gone(tmp_path: Path) -> None:
    token = support.write_record(tmp_path / "state")
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid no longer exists
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF")
    with pytest.raises(oci.HookError, match=rf"container init \(pid {p.pid}\) is gone"):
        prestart.run(_decision(tmp_path, token, p.pid), str(tmp_path / "state"), str(lib))
    assert not (tmp_path / "state" / "containers" / "c1").exists()


@pytest.mark.root
def test_full_disk_fails_closed_and_cleans_up(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    state = tmp_path / "state"
    token = support.write_record(state)
    small = state / "containers"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        lib = tmp_path / "lib.so"
        lib.write_bytes(b"\x7fELF")
        with pytest.raises(oci.HookError, match="No space left on device"):
            prestart.run(_decision(tmp_path, token, os.getpid()), str(state), str(lib))
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_token_container_without_config_json_is_refused(tmp_path: Path) -> None:
    state = json.dumps({"id": "c1", "pid": 1, "bundle": str(tmp_path), "annotations": {oci.TOKEN_ANNOTATION: "x"}})
    d = oci.decide_prestart(state.encode())
    assert isinstance(d, oci.Fail) and "config.json" in d.message
    d2 = oci.decide_prestart(json.dumps({"id": "c1", "pid": 1, "bundle": str(tmp_path)}).encode())
    assert isinstance(d2, oci.Skip) and d2.log and "config.json" in d2.log


def test_record_of_another_token_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    token = support.write_record(state)
    other = "a" * 32
    os.rename(state / "allocations" / f"{token}.json", state / "allocations" / f"{other}.json")
    from vgpu import paths

    with pytest.raises(oci.HookError, match="belongs to another token"):
        prestart.load_record(paths.Paths(str(state)), other)


def test_hook_log_is_bounded(tmp_path: Path) -> None:
    log = hooklog.HookLog(str(tmp_path / "log"), max_bytes=2000, level="info")
    for i in range(500):
        log.info(kv("line", n=i, text="x y"))
    log.debug("not written")
    files = sorted(p.name for p in (tmp_path / "log").iterdir())
    assert files == ["hook.log", "hook.log.1"]
    assert all(p.stat().st_size <= 2000 for p in (tmp_path / "log").iterdir())
    assert "n=499 text='x y'" in (tmp_path / "log" / "hook.log").read_text()
    assert "not written" not in (tmp_path / "log" / "hook.log").read_text()
