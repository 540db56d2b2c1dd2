"""Virtual device memory through the real chain: the device plugin's allocator writes the
records (K = 2, memory scaling 2 on a simulated 16 GiB GPU), our OCI hook under runc renders the
limits and mounts the library, region and /etc/ld.so.preload, and two containers each allocate
their 16 GiB slice. The simulated GPU's own count shows 8 GiB of each on the device."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_plugin.allocator import slice_for
from nodecore.devices import DeviceTable, Slicing
from nodecore.records import RecordStore, ensure_dir
from sim.fakegpu.harness import FakeGPU
from tests.support import hook as support
from vgpu import limits as vlimits
from vgpu.nvml import GPUInfo
from vgpu.paths import Paths

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not support.have_runc(), reason="needs root, runc and busybox-static"),
]

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu(tmp_path: Path, build_dir: Path) -> Iterator[FakeGPU]:
    g = FakeGPU(tmp_path / "fakegpu", build_dir, gpus=1, memory=16 * GiB, context_overhead=0)
    try:
        yield g
    finally:
        g.close()


def _bundle(node: support.Node, gpu: FakeGPU, token: str, name: str, out: Path, script: str) -> Path:
    rootfs = support.make_cdi_rootfs(node.base / f"rootfs-{name}")
    b = node.bundle(
        ["sh", "-c", script],
        rootfs=rootfs,
        env=[
            f"VGPU_ALLOCATION_TOKEN={token}",
            "LD_LIBRARY_PATH=/opt/fakegpu",
            "FAKEGPU_STATE=/var/lib/fakegpu/state",
            "FAKEGPU_CONFIG=/var/lib/fakegpu/conf",
        ],
    )
    spec = json.loads((b / "config.json").read_text())
    binds = [
        ("/usr/lib", "/usr/lib", "ro"),
        ("/usr/lib64", "/usr/lib64", "ro"),
        (str(gpu.lib_dir), "/opt/fakegpu", "ro"),
        (str(ROOT / "build" / "intercept" / "cutest"), "/opt/cutest", "ro"),
        (str(gpu.state_path), "/var/lib/fakegpu/state", "rw"),
        (str(gpu.config_path), "/var/lib/fakegpu/conf", "ro"),
        (str(out), "/out", "rw"),
    ]
    for src, dst, mode in binds:
        if Path(src).exists():
            spec["mounts"].append({"destination": dst, "type": "bind", "source": src, "options": ["rbind", mode]})
    (b / "config.json").write_text(json.dumps(spec))
    return b


def _wait_for(path: Path, needle: str, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in {path}: {path.read_text() if path.exists() else ''}")


def test_two_containers_fill_their_slices_through_the_hook(tmp_path: Path, gpu: FakeGPU, hook_lib: Path) -> None:
    if hook_lib.name != "libvgpu.so":
        pytest.skip("build/libvgpu.so not built")
    (tmp_path / "node").mkdir()
    node = support.Node(tmp_path / "node", hook_lib)
    paths = Paths(str(node.state))
    ensure_dir(paths)
    table = DeviceTable([GPUInfo(0, gpu.uuids[0], "Fake", 16 * GiB, None, None)], Slicing(2, 2.0))
    ids = table.all_ids()
    store = RecordStore(paths, "nvidia.com/gpu")
    tokens = [store.write(slice_for(table, [vid]).gpus, table.slicing.oversubscribe).token for vid in ids]
    out = tmp_path / "out"
    out.mkdir()
    script = (
        "/opt/cutest gpa init "
        + " ".join(["managed 1073741824"] * 8 + ["alloc 1073741824"] * 8)
        + " touch sleepms 600000 > /out/{n}.log 2>&1"
    )
    started = []
    try:
        for n, token in zip(("a", "b"), tokens, strict=True):
            b = _bundle(node, gpu, token, n, out, script.format(n=n))
            r = support.runc_detach(node.runc_root, b, f"ovs-{n}")
            assert r.returncode == 0, r.stderr
            started.append(f"ovs-{n}")
            text = _wait_for(out / f"{n}.log", "touch rc=")
            assert text.count("rc=0") == 18, text  # init, 16 allocations, the touch
        # the hook rendered the physical share from the record
        for cid in started:
            lim = vlimits.parse((node.state / "containers" / cid / "limits").read_text())
            assert [(d.memory_limit, d.device_limit, d.oversubscribe) for d in lim] == [(16 * GiB, 8 * GiB, True)]
        st = gpu.state()
        used = [p["devices"][0]["used"] for p in st["processes"]]
        assert sorted(used) == [8 * GiB, 8 * GiB], st["processes"]  # each holds its share, no more
        assert st["devices"][0]["used"] == 16 * GiB
    finally:
        for cid in started:
            support.runc(node.runc_root, "kill", cid, "KILL")
            support.runc(node.runc_root, "delete", "--force", cid)
