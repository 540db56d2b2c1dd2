"""The plugin's gRPC behaviour towards a kubelet stand-in (real gRPC over unix sockets).

The daemon runs in a thread over synthetic GPUs here; tests/plugin/test_process.py
runs the real binary over the simulated NVML.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import grpc
import pytest

from tests.plugin.conftest import GiB, synthetic_gpus
from tests.support.kubelet import FakeKubelet
from vgpu.paths import valid_token
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV, read_record

pytestmark = pytest.mark.timeout(120)


def test_registration_and_device_list(kubelet: FakeKubelet, inproc) -> None:
    inproc(device_split_count=3)
    reg = kubelet.wait_registration()
    assert reg.version == "v1beta1"
    assert reg.endpoint == "vgpu.sock"
    assert reg.resource_name == "nvidia.com/gpu"
    assert reg.get_preferred_allocation_available and not reg.pre_start_required
    ep = kubelet.wait_endpoint()
    assert ep.options is not None and ep.options.get_preferred_allocation_available
    devs = ep.devices()
    gpus = synthetic_gpus()
    assert sorted(devs) == sorted(f"{g.uuid}::{i}" for g in gpus for i in range(3))
    for d in devs.values():
        assert d.healthy
        uuid = d.id.rpartition("::")[0]
        assert d.numa == (next(g.numa_node for g in gpus if g.uuid == uuid),)
    assert os.path.exists(os.path.join(kubelet.device_plugins_dir, "vgpu.sock"))


def test_custom_resource_and_socket(kubelet: FakeKubelet, inproc) -> None:
    inproc(resource_name="example.com/vgpu", socket_name="x.sock", device_split_count=1)
    reg = kubelet.wait_registration()
    assert (reg.resource_name, reg.endpoint) == ("example.com/vgpu", "x.sock")
    assert len(kubelet.wait_endpoint("example.com/vgpu").devices()) == 2


def test_no_topology_when_numa_unknown(kubelet: FakeKubelet, inproc) -> None:
    from dataclasses import replace

    inproc(gpus=[replace(g, numa_node=None) for g in synthetic_gpus(1)])
    devs = kubelet.wait_endpoint().devices()
    assert len(devs) == 2 and all(d.numa == () for d in devs.values())


def test_allocate_one_vgpu_writes_record(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(device_split_count=4, device_memory_scaling=1.0, device_cores_scaling=1.0)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "pod-a", "main", count=1)
    assert len(a.device_ids) == 1
    uuid = a.device_ids[0].rpartition("::")[0]
    token = a.envs[TOKEN_ENV]
    assert valid_token(token)
    assert a.annotations == {TOKEN_ANNOTATION: token}
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": uuid, TOKEN_ENV: token}  # no limit values in env
    rec = read_record(p.state.allocation_record(token))
    assert rec.token == token and rec.resource_name == "nvidia.com/gpu" and not rec.oversubscribe
    assert abs(rec.created - time.time()) < 60
    assert len(rec.gpus) == 1
    g = rec.gpus[0]
    assert (g.uuid, g.memory_limit, g.core_percent, g.vgpu_ids) == (uuid, 4 * GiB, 25, list(a.device_ids))


def test_allocate_two_vgpus_on_distinct_gpus(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(device_split_count=2, device_memory_scaling=2.0, device_cores_scaling=0.5)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "pod-b", "main", count=2)
    uuids = [d.rpartition("::")[0] for d in a.device_ids]
    assert len(set(uuids)) == 2, "preferred allocation must use distinct GPUs"
    assert a.preferred == a.device_ids
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(uuids)
    rec = read_record(p.state.allocation_record(a.envs[TOKEN_ENV]))
    assert rec.oversubscribe
    assert [g.uuid for g in rec.gpus] == uuids
    assert all(g.memory_limit == 16 * GiB and g.core_percent == 25 for g in rec.gpus)


def test_allocate_merges_same_gpu(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(device_split_count=4)
    ep = kubelet.wait_endpoint()
    u = synthetic_gpus()[0].uuid
    resp = ep.allocate([f"{u}::1", f"{u}::3"])
    rec = read_record(p.state.allocation_record(resp.envs[TOKEN_ENV]))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == u
    assert len(rec.gpus) == 1
    assert (rec.gpus[0].memory_limit, rec.gpus[0].core_percent) == (8 * GiB, 50)
    assert rec.gpus[0].vgpu_ids == [f"{u}::1", f"{u}::3"]


@pytest.mark.parametrize(
    ("ids", "needle"),
    [
        (["GPU-ffffffff-0000-0000-0000-000000000000::0"], "unknown device IDs"),
        (["nonsense"], "unknown device IDs"),
        ([], "empty device list"),
    ],
)
def test_allocate_rejects_unknown(kubelet: FakeKubelet, inproc, ids: list[str], needle: str) -> None:
    p = inproc()
    ep = kubelet.wait_endpoint()
    with pytest.raises(grpc.RpcError) as e:
        ep.allocate(ids)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()
    assert os.listdir(p.state.allocations_dir) == []


def test_allocate_rejects_unhealthy(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(device_split_count=2)
    ep = kubelet.wait_endpoint()
    u = synthetic_gpus()[1].uuid
    assert p.daemon.table.mark_unhealthy(u, "test")
    devs = ep.wait_devices(lambda d: not d[f"{u}::0"].healthy)
    assert not devs[f"{u}::1"].healthy
    assert all(d.healthy for i, d in devs.items() if not i.startswith(u))
    with pytest.raises(grpc.RpcError) as e:
        ep.allocate([f"{u}::0"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unhealthy" in e.value.details()
    p.daemon.table.mark_healthy(u)
    ep.wait_devices(lambda d: all(x.healthy for x in d.values()))


@pytest.mark.parametrize(("policy", "expect_gpu"), [("spread", 1), ("binpack", 0)])
def test_preferred_allocation_policies(kubelet: FakeKubelet, inproc, policy: str, expect_gpu: int) -> None:
    inproc(gpus=synthetic_gpus(2), device_split_count=4, allocation_policy=policy)
    ep = kubelet.wait_endpoint()
    g0, g1 = (g.uuid for g in synthetic_gpus(2))
    # GPU 0 already has two vGPUs allocated (not available), GPU 1 none.
    available = [f"{g0}::2", f"{g0}::3", *(f"{g1}::{i}" for i in range(4))]
    (one,) = ep.preferred(available, 1)
    assert one.startswith((g0, g1)[expect_gpu])
    two = ep.preferred(available, 2)
    assert {d.rpartition("::")[0] for d in two} == {g0, g1}
    must = ep.preferred(available, 2, must_include=[f"{g1}::3"])
    assert must[0] == f"{g1}::3" and must[1].startswith(g0)


def test_kubelet_restart_ten_times(kubelet: FakeKubelet, inproc) -> None:
    inproc(device_split_count=2)
    kubelet.wait_endpoint()
    sock = os.path.join(kubelet.device_plugins_dir, "vgpu.sock")
    for i in range(10):
        st = os.stat(sock)
        before = (st.st_ino, st.st_ctime_ns)
        kubelet.restart()  # deletes vgpu.sock, recreates kubelet.sock
        reg = kubelet.wait_registration(count=i + 2, timeout=20)
        st = os.stat(sock)
        assert (st.st_ino, st.st_ctime_ns) != before, "the plugin serves a new socket"
        assert reg.resource_name == "nvidia.com/gpu"
        ep = kubelet.wait_endpoint(timeout=20)
        assert len(ep.devices()) == 4
    # still serving allocations after all that
    assert kubelet.admit("default", "after", "c", 1).envs[TOKEN_ENV]


def test_plugin_restart_keeps_records(kubelet: FakeKubelet, inproc) -> None:
    p = inproc()
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "pod", "c", 1)
    path = p.state.allocation_record(a.envs[TOKEN_ENV])
    before = Path(path).read_bytes()
    p.stop()
    assert not os.path.exists(os.path.join(kubelet.device_plugins_dir, "vgpu.sock")), "socket removed on stop"
    inproc()
    kubelet.wait_registration(count=2)
    kubelet.wait_endpoint()
    assert Path(path).read_bytes() == before


def test_pod_resources_cleanup(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(record_gc_grace_s=0.5, record_gc_interval_s=0.2)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "short", "c", 1)
    b = kubelet.admit("default", "long", "c", 1)
    pa = p.state.allocation_record(a.envs[TOKEN_ENV])
    pb = p.state.allocation_record(b.envs[TOKEN_ENV])
    time.sleep(1.5)  # several GC passes: both still assigned
    assert os.path.exists(pa) and os.path.exists(pb)
    assert kubelet.pod_resources_calls > 0
    kubelet.release("default", "short")
    deadline = time.monotonic() + 20
    while os.path.exists(pa) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(pa)
    assert os.path.exists(pb)


def test_records_kept_without_pod_resources(tmp_path: Path, inproc, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="device_plugin")
    with FakeKubelet(tmp_path / "kubelet", pod_resources=False) as k:
        p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=0.1)
        k.wait_endpoint()
        a = k.admit("default", "gone", "c", 1)
        k.release("default", "gone")
        time.sleep(1.5)
        assert os.path.exists(p.state.allocation_record(a.envs[TOKEN_ENV]))
        msgs = [r.getMessage() for r in caplog.records if "PodResources API unavailable" in r.getMessage()]
        assert len(msgs) == 1, msgs


def test_crashed_server_and_lost_socket_are_restarted(
    kubelet: FakeKubelet, inproc, monkeypatch: pytest.MonkeyPatch
) -> None:
    import device_plugin.daemon as daemon_mod

    monkeypatch.setattr(daemon_mod, "_LIVENESS_S", 0.3)
    monkeypatch.setattr(daemon_mod, "_TICK_S", 0.1)
    p = inproc()
    kubelet.wait_endpoint()
    # gRPC server dies under the daemon: re-served and re-registered
    assert p.daemon.server is not None and p.daemon.server.server is not None
    p.daemon.server.server.stop(0).wait(5)
    kubelet.wait_registration(count=2, timeout=20)
    assert len(kubelet.wait_endpoint(timeout=20).devices()) == 4
    # socket deleted by someone, kubelet not restarted: same
    os.unlink(os.path.join(kubelet.device_plugins_dir, "vgpu.sock"))
    kubelet.wait_registration(count=3, timeout=20)
    assert kubelet.admit("default", "x", "c", 1).envs[TOKEN_ENV]
    assert p.daemon.restarts == 2


def test_plugin_started_before_kubelet(tmp_path: Path, inproc) -> None:
    inproc()
    time.sleep(0.5)  # serving, but no kubelet.sock yet
    with FakeKubelet(tmp_path / "kubelet") as k:
        reg = k.wait_registration(timeout=20)
        assert reg.resource_name == "nvidia.com/gpu"
        assert len(k.wait_endpoint().devices()) == 4


def test_registration_refused_by_kubelet_is_retried_quietly(
    kubelet: FakeKubelet, inproc, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import device_plugin.daemon as daemon_mod

    monkeypatch.setattr(daemon_mod, "_REGISTER_RETRY_S", 0.2)
    monkeypatch.setattr(daemon_mod, "_TICK_S", 0.1)
    caplog.set_level(logging.DEBUG, logger="device_plugin")
    inproc(resource_name="kubernetes.io/gpu")  # native name: kubelet refuses it
    deadline = time.monotonic() + 20
    while len(kubelet.rejected) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kubelet.rejected) >= 3 and kubelet.registrations == []
    assert "kubernetes.io/gpu" in kubelet.rejected[0][1]
    warnings = [r for r in caplog.records if "registration failed" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1
