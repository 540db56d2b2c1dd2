"""What operators see of MIG: `vgpuctl status` (a MIG device's line, its users, shares not
enforced), the monitor's metrics (the MIG UUID and its GPU), `vgpuctl doctor`'s MIG checks on
simulated layouts (modes, instances, who uses them, whether the strategy can serve them)."""

from __future__ import annotations

import types

from monitor.metrics import SnapshotCollector
from sim.fakegpu.mig import product
from tests.support.mig import discover
from vgpu.config import NodeConfig, load_config
from vgpuctl import cli, migcheck

GPU = "GPU-4a1e0b6c-8d3f-4c2a-9e7b-000000000000"
MIG = "MIG-5d01b446-99c9-5f00-a857-12dbe04d0459"


def snapshot() -> dict:
    row = {"container_id": "c1" * 6, "namespace": "ns1", "pod": "train", "container": "main", "claim": "",
           "pids": [7], "memory_used": 5 << 30, "memory_limit": 17 << 30, "sm_use": 0.0, "share": 25,
           "effective_share": None, "duty": 1.0, "suspended": False, "backstop_actions": {}}  # fmt: skip
    return {
        "time": 1000.0, "pid": 1, "policy": "contended", "running": True, "suspended_processes": 0,
        "gpus": [
            {"index": 0, "uuid": GPU, "name": "NVIDIA H200", "up": True, "error": "", "memory_total": 143771 << 20,
             "memory_used": 5 << 30, "util": 0, "parent": "", "compute_enforced": True, "containers": [],
             "allocated": []},
            {"index": 0, "uuid": MIG, "name": "NVIDIA H200 MIG 3g.71gb", "up": True, "error": "",
             "memory_total": 71680 << 20, "memory_used": 5 << 30, "util": 0, "parent": GPU,
             "compute_enforced": False, "containers": [row], "allocated": []},
        ],
        "containers": [], "errors": {}, "guardian_armed": True, "gc_removed": 0,
    }  # fmt: skip


def test_status_shows_the_mig_device_and_its_users() -> None:
    text = cli.render(snapshot(), now=1001.0)
    line = next(ln for ln in text.splitlines() if MIG in ln)
    assert line.startswith("MIG of GPU 0") and "NVIDIA H200 MIG 3g.71gb" in line
    assert "compute shares not enforced (MIG)" in line
    after = text.split(line, 1)[1]
    assert "ns1/train" in after.splitlines()[2]


def test_metrics_carry_the_mig_uuid() -> None:
    fams = {f.name: f for f in SnapshotCollector(types.SimpleNamespace(snapshot=snapshot())).collect()}
    info = fams["vgpu_mig_device_info"].samples
    assert [(s.labels, s.value) for s in info] == [({"gpu": "0", "uuid": MIG, "parent_uuid": GPU}, 1.0)]
    assert [s.value for s in fams["vgpu_mig_compute_shares_enforced"].samples] == [0.0]
    used = {s.labels["uuid"]: s.value for s in fams["vgpu_container_memory_limit_bytes"].samples}
    assert used == {MIG: 17 << 30}


def cfg(strategy: str) -> NodeConfig:
    return load_config(None, {"device_plugin.mig_strategy": strategy})


def test_doctor_reads_the_layout_and_judges_the_strategy(fakegpu) -> None:
    fakegpu.configure([product("h200-141gb", mig_mode=1)])
    big, small = fakegpu.mig_create(0, "3g.71gb", "1g.18gb")
    layout = discover(fakegpu.env)
    status = {"gpus": [{"uuid": big["uuid"], "containers": [{"namespace": "ns1", "pod": "train"}], "allocated": []}]}
    got = migcheck.check(layout, cfg("mixed"), status)
    listing = next(m for s, m, _ in got if "MIG on" in m)
    assert f"3g.71gb {big['uuid']} (gi {big['gi']} ci 0; ns1/train)" in listing
    assert f"1g.18gb {small['uuid']} (gi {small['gi']} ci 0; unused)" in listing
    assert ("OK", "mig_strategy mixed offers nvidia.com/mig-1g.18gb: 1, nvidia.com/mig-3g.71gb: 1", "") in got
    single = migcheck.check(layout, cfg("single"), None)
    assert any(s == "FAIL" and "more than one MIG device type" in m for s, m, _ in single)
    none = migcheck.check(layout, cfg("none"), None)
    assert any(s == "WARN" and "mig_strategy = none" in m for s, m, _ in none)
    fakegpu.mig_destroy(0)
    empty = migcheck.check(discover(fakegpu.env), cfg("vgpu"), None)
    assert any(s == "WARN" and "without MIG devices" in m for s, m, _ in empty)
    dynamic = migcheck.check(discover(fakegpu.env), cfg("dynamic"), None)
    assert any(s == "OK" and "MIG on, no instance: made per scheduled container" in m for s, m, _ in dynamic)
    assert any(s == "WARN" and "device_split_count 2" in m for s, m, _ in dynamic)  # the default split count
