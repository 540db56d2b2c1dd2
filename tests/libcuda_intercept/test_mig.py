"""libvgpu.so on a MIG device: the limits line of a vGPU inside a MIG instance is keyed by the MIG
UUID (contract 4; cuDeviceGetUuid_v2 gives a MIG device's UUID), the process sees its slice of
the instance and is refused past it, judged by the simulator's own count of the instance."""

from __future__ import annotations

import json
import subprocess

from tests.libcuda_intercept.support import FAKE, GiB, MiB, Node

H200 = "[device]\nname = NVIDIA H200\nmemory = {mem}\nmig_profiles = h200-141gb\nmig_mode = 1\ncontext_overhead = 0\n"
INSTANCE = 71680 * MiB  # 3g.71gb


def mig_node(node: Node, *profiles: str) -> list[dict]:
    node.write_config(H200.format(mem=143771 * MiB))
    out = subprocess.run(
        [str(FAKE / "fakegpu-ctl"), "mig-create", "0", ",".join(profiles)],
        env=node.env(False), capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines()]


def instance_used(node: Node, uuid: str) -> int:
    for g in node.dump()["mig"]:
        for gi in g["gpu_instances"]:
            for ci in gi["compute_instances"]:
                if ci["uuid"] == uuid:
                    return int(ci["used"])
    raise KeyError(uuid)


def test_a_vgpu_inside_a_3g_instance(node: Node) -> None:
    """A quarter of a 3g.71gb instance: the process sees the quarter and gets no more; the
    instance holds exactly what it was allowed."""
    big, small = mig_node(node, "3g.71gb", "1g.18gb")
    share = INSTANCE // 4
    node.limit(share, uuid=big["uuid"], pct=25)
    env = {"CUDA_VISIBLE_DEVICES": big["uuid"]}
    r = node.cutest("gpa", "init", "info", "total", "alloc", share - GiB, "alloc", 2 * GiB, "info", env=env)
    assert r.one("info", 0) == {"_": "info", "rc": "0", "free": str(share), "total": str(share)}
    assert r.one("total")["bytes"] == str(share)
    assert r.one("alloc", 0)["rc"] == "0"
    assert r.one("alloc", 1)["rc"] == "2"  # CUDA_ERROR_OUT_OF_MEMORY: past the slice
    assert r.one("info", 1)["free"] == str(GiB)
    p = node.popen("gpa", "init", "alloc", share - GiB, "wait", env=env)
    try:
        assert p.stdout is not None
        while "waiting" not in p.stdout.readline():
            pass
        assert instance_used(node, big["uuid"]) == share - GiB  # the simulator's count
        assert instance_used(node, small["uuid"]) == 0
    finally:
        p.kill()
        p.wait()


def test_the_gpus_line_does_not_cover_its_mig_devices(node: Node) -> None:
    """A limits file naming only the GPU: the MIG device has no line, so its allocations are
    refused (fail closed), not limited by the GPU's line."""
    (big,) = mig_node(node, "3g.71gb")
    gpu_uuid = "GPU-fa6e0000-0000-4000-8000-000000000100"  # the default UUID of device 0
    node.limit(100 * GiB, uuid=gpu_uuid)
    r = node.cutest("gpa", "init", "alloc", MiB, env={"CUDA_VISIBLE_DEVICES": big["uuid"]})
    assert r.one("alloc")["rc"] != "0"
    assert instance_used(node, big["uuid"]) == 0
