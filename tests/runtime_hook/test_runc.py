"""The hook under real runc (Debian's runc 1.1): a busybox bundle with our hooks in config.json."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support import hook as support
from tests.support.hook import Node

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

CHECK = (
    "echo preload=$(cat /etc/ld.so.preload | tr '\\n' ' ' 2>/dev/null || cat /etc/ld.so.preload); "
    "cat /run/vgpu/limits; "
    "stat -c 'mode %n %a %F' /etc/ld.so.preload /run/vgpu/libvgpu.so /run/vgpu/limits /run/vgpu/region; "
    "for f in /etc/ld.so.preload /run/vgpu/libvgpu.so /run/vgpu/limits /run/vgpu/region; do "
    "(echo x >> $f) 2>/dev/null && echo write $f ok || echo write $f refused; done; "
    "grep -c . /run/vgpu/region >/dev/null; echo region-size=$(stat -c %s /run/vgpu/region)"
)


def _lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return r.stdout.splitlines()


def test_vgpu_container_gets_files_modes_and_readonly_binds(any_node: Node) -> None:
    node = any_node
    token = support.write_record(node.state, [(support.UUID_A, 3 << 30, 40), (support.UUID_B, 1 << 30, 60)])
    env = [f"VGPU_ALLOCATION_TOKEN={token}", f"NVIDIA_VISIBLE_DEVICES={support.UUID_B},{support.UUID_A}"]
    b = node.bundle(["sh", "-c", CHECK], env=env)
    r = node.run(b, "vg1")
    assert r.returncode == 0, r.stderr
    out = _lines(r)
    assert "preload=/run/vgpu/libvgpu.so" in out[0]
    # the limits: slice, share, no oversubscription, physical share = slice
    assert f"{support.UUID_A} {3 << 30} 40 0 {3 << 30}" in out and f"{support.UUID_B} {1 << 30} 60 0 {1 << 30}" in out
    assert "mode /etc/ld.so.preload 644 regular file" in out
    assert "mode /run/vgpu/limits 644 regular file" in out
    assert "mode /run/vgpu/region 666 regular file" in out
    for f in ("/etc/ld.so.preload", "/run/vgpu/libvgpu.so", "/run/vgpu/limits"):
        assert f"write {f} refused" in out, out
    assert "write /run/vgpu/region ok" in out
    # runc deleted the container: poststop removed the state directory.
    assert node.containers() == []
    # The library on the host was not touched by the write attempt.
    assert b"x\n" not in node.lib.read_bytes()[-2:]


def test_state_dir_contents_while_running(any_node: Node) -> None:
    node = any_node
    token = support.write_record(node.state)
    ann = {
        "vgpu.k8s.io/allocation-token": token,
        "io.kubernetes.cri.sandbox-name": "p1",
        "io.kubernetes.cri.sandbox-namespace": "ns1",
        "io.kubernetes.cri.container-name": "c",
    }
    b = node.bundle(["sleep", "30"], annotations=ann)
    r = support.runc_detach(node.runc_root, b, "vg2")
    try:
        assert r.returncode == 0, r.stderr
        d = node.state / "containers" / "vg2"
        assert sorted(os.listdir(d)) == ["ld.so.preload", "limits", "metadata.json", "region"]
        assert oct(os.stat(d).st_mode & 0o777) == "0o700"
        meta = json.loads((d / "metadata.json").read_text())
        st = json.loads(support.runc(node.runc_root, "state", "vg2").stdout)
        assert meta["init_pid"] == st["pid"] and meta["init_start_time"] > 0
        assert (meta["pod_namespace"], meta["pod_name"], meta["container_name"]) == ("ns1", "p1", "c")
        assert meta["token"] == token and meta["gpus"][0]["uuid"] == support.UUID_A
        from vgpu import region

        snap = region.read_region(str(d / "region"))
        assert snap.devices[0].uuid == support.UUID_A and snap.devices[0].memory_limit == 4 << 30
        # Nothing leaked into the host mount namespace.
        assert "/run/vgpu" not in Path("/proc/self/mountinfo").read_text()
    finally:
        support.runc(node.runc_root, "delete", "--force", "vg2")
    assert node.containers() == []


def test_image_preload_entries_are_kept(node: Node) -> None:
    token = support.write_record(node.state)
    rootfs = support.make_rootfs(node.base / "rf")
    (rootfs / "etc" / "ld.so.preload").write_text(
        "# image's own\n/usr/lib/libfoo.so:/lib/libbar.so\n/run/vgpu/libvgpu.so\n"
    )
    b = node.bundle(["cat", "/etc/ld.so.preload"], env=[f"VGPU_ALLOCATION_TOKEN={token}"], rootfs=rootfs)
    r = node.run(b, "vg3")
    assert r.returncode == 0, r.stderr
    assert _lines(r) == ["/run/vgpu/libvgpu.so", "/usr/lib/libfoo.so", "/lib/libbar.so"]
    # The image's file itself is unchanged (we mounted over it).
    assert "libfoo" in (rootfs / "etc" / "ld.so.preload").read_text()


def test_readonly_rootfs(node: Node) -> None:
    token = support.write_record(node.state)
    script = "cat /run/vgpu/limits >/dev/null && echo mounted; (touch /newfile) 2>/dev/null && echo rw || echo ro"
    b = node.bundle(["sh", "-c", script], env=[f"VGPU_ALLOCATION_TOKEN={token}"], readonly=True)
    r = node.run(b, "vg4")
    assert r.returncode == 0, r.stderr
    assert _lines(r) == ["mounted", "ro"]


def test_plain_container_untouched(any_node: Node) -> None:
    node = any_node
    b = node.bundle(
        ["sh", "-c", "test -e /run/vgpu && echo has || echo none; test -e /etc/ld.so.preload || echo nopre"]
    )
    before = support.snapshot([b / "rootfs"])
    r = node.run(b, "plain1")
    assert r.returncode == 0, r.stderr
    assert _lines(r) == ["none", "nopre"]
    assert support.snapshot([b / "rootfs"]) == before
    assert node.containers() == [] and not (node.state / "containers").exists()


@pytest.mark.parametrize(
    "case",
    [
        "unknown-token",
        "bad-token",
        "devices-outside",
        "devices-all",
        "no-library",
        "malformed-record",
        "mismatch",
        "oversubscribed-without-share",
    ],
)
def test_refused_containers(any_node: Node, case: str) -> None:
    node = any_node
    token = support.write_record(node.state)
    env = [f"VGPU_ALLOCATION_TOKEN={token}"]
    ann: dict[str, str] = {}
    expect = ""
    if case == "unknown-token":
        env = ["VGPU_ALLOCATION_TOKEN=" + "0" * 32]
        expect = "unknown vGPU allocation token"
    elif case == "bad-token":
        env = ["VGPU_ALLOCATION_TOKEN=../../etc/passwd"]
        expect = "invalid vGPU allocation token"
    elif case == "devices-outside":
        env.append(f"NVIDIA_VISIBLE_DEVICES={support.UUID_A},{support.UUID_B}")
        expect = f"NVIDIA_VISIBLE_DEVICES names GPUs outside the vGPU allocation: {support.UUID_B}"
    elif case == "devices-all":
        env.append("NVIDIA_VISIBLE_DEVICES=all")
        expect = "outside the vGPU allocation: all"
    elif case == "no-library":
        node.lib = node.base / "missing.so"
        expect = "vGPU library"
    elif case == "malformed-record":
        (node.state / "allocations" / f"{token}.json").write_text('{"version": 1, "token": 5}')
        expect = "malformed vGPU allocation record"
    elif case == "mismatch":
        ann = {"vgpu.k8s.io/allocation-token": "f" * 32}
        expect = "disagree"
    elif case == "oversubscribed-without-share":
        # a record from before the physical share existed, with memory scaling above 1
        p = node.state / "allocations" / f"{token}.json"
        p.write_text(p.read_text().replace('"oversubscribe":false', '"oversubscribe":true'))
        expect = "an oversubscribed allocation without device_limit"
    b = node.bundle(["echo", "STARTED"], env=env, annotations=ann)
    r = node.run(b, f"ref-{case}")
    assert r.returncode != 0
    assert "STARTED" not in r.stdout
    assert expect in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert node.containers() == []


def test_shell_filter_never_starts_python_for_plain_containers(node: Node) -> None:
    python, calls = support.recording_python(node.base)
    hooks = support.hooks(node.state, node.lib, node.logs, shell=True, python=python)
    plain = support.make_bundle(node.base / "plain", ["true"], hook=hooks)
    for i in range(3):
        assert node.run(plain, f"flt-plain{i}").returncode == 0
    assert not calls.exists(), calls.read_text()
    token = support.write_record(node.state)
    vgpu = support.make_bundle(node.base / "vgpu", ["true"], hook=hooks, env=[f"VGPU_ALLOCATION_TOKEN={token}"])
    r = node.run(vgpu, "flt-vgpu")
    assert r.returncode == 0, r.stderr
    assert calls.read_text().split() == ["prestart"]  # poststop: the filter's rm
    assert node.containers() == []
