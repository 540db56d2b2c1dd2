"""The plugin's gRPC behaviour towards a kubelet stand-in (real gRPC over unix sockets).

The daemon runs in a thread over synthetic GPUs here; tests/device_plugin/test_process.py
runs the real binary over the simulated NVML.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import grpc
import pytest

from sim.kubelet import READMIT_AFTER_S, ContainerSpec, FakeKubelet
from tests.device_plugin.conftest import GiB, InProc, synthetic_gpus
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
    assert g.device_limit == 4 * GiB  # no oversubscription: the whole slice may be on the GPU


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
    assert all(g.device_limit == 8 * GiB for g in rec.gpus)  # its physical share: M/K of a 16 GiB GPU


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


def _wait_gone(path: str, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def _gc_passes(p: InProc, n: int = 3) -> None:
    for _ in range(n):
        p.daemon.gc_once()


def test_records_live_while_the_kubelet_keeps_their_answer(kubelet: FakeKubelet, inproc) -> None:
    """A record goes once the kubelet's checkpoint no longer holds its Allocate answer: not when
    the pod is deleted, but when the kubelet next writes its checkpoint (here: its next admission),
    as kubelet's device manager drops a gone pod's entries (manager.go UpdateAllocatedDevices,
    writeCheckpoint)."""
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "short", "c", 1)
    b = kubelet.admit("default", "long", "c", 1)
    pa = p.state.allocation_record(a.envs[TOKEN_ENV])
    pb = p.state.allocation_record(b.envs[TOKEN_ENV])
    _gc_passes(p)
    assert os.path.exists(pa) and os.path.exists(pb)
    kubelet.release("default", "short")
    _gc_passes(p)
    assert os.path.exists(pa), "the kubelet's checkpoint still holds the deleted pod's answer"
    c = kubelet.admit("default", "next", "c", 1)  # prunes the gone pod, rewrites the checkpoint
    assert p.daemon.gc_once() == [a.envs[TOKEN_ENV]]
    assert not os.path.exists(pa)
    assert os.path.exists(pb) and os.path.exists(p.state.allocation_record(c.envs[TOKEN_ENV]))


def test_collector_runs_on_its_own(kubelet: FakeKubelet, inproc) -> None:
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=0.1)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "gone", "c", 1)
    kubelet.release("default", "gone")
    kubelet.admit("default", "next", "c", 1)
    assert _wait_gone(p.state.allocation_record(a.envs[TOKEN_ENV]))


@pytest.mark.parametrize("damage", ["missing", "garbage", "bad entry"])
def test_records_kept_when_the_checkpoint_is_unusable(
    kubelet: FakeKubelet, inproc, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    caplog.set_level(logging.WARNING, logger="device_plugin")
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "gone", "c", 1)
    kubelet.release("default", "gone")
    kubelet.admit("default", "next", "c", 1)
    ck = Path(kubelet.checkpoint_path)
    if damage == "missing":
        ck.unlink()
    elif damage == "garbage":
        ck.write_bytes(b"{not json")
    else:
        ck.write_text('{"Data":{"PodDeviceEntries":[{"ResourceName":"nvidia.com/gpu","AllocResp":"%%%"}]}}')
    _gc_passes(p)
    assert os.path.exists(p.state.allocation_record(a.envs[TOKEN_ENV]))
    msgs = [r.getMessage() for r in caplog.records if "checkpoint unusable" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_init_container_records_survive_while_the_pod_exists(kubelet: FakeKubelet, inproc) -> None:
    """The kubelet gives the init container's vGPU to the app container (two Allocate
    calls, same ID, two tokens) and replays the init container's answer when the sandbox is
    recreated. Its record must outlive every GC pass while the pod exists, and the replay must
    find exactly the limits it had."""
    from runtime_hook import prestart
    from vgpu import limits as vlimits

    def limits(token: str) -> str:  # what the hook writes for the token (a HookError if unknown)
        return vlimits.render(vlimits.from_record(prestart.load_record(p.state, token)))

    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600, device_split_count=4)
    kubelet.wait_endpoint()
    first = kubelet.admit_pod("default", "job", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)])
    assert first["init"].device_ids == first["app"].device_ids  # the app reuses the init's vGPU
    tokens = {c: a.envs[TOKEN_ENV] for c, a in first.items()}
    assert tokens["init"] != tokens["app"]
    before = {c: limits(t) for c, t in tokens.items()}
    kubelet.admit("default", "other", "c", 1)  # another checkpoint write, another record
    _gc_passes(p)
    again = kubelet.recreate_sandbox("default", "job")
    assert {c: a.envs[TOKEN_ENV] for c, a in again.items()} == tokens  # replayed, not re-allocated
    assert {c: limits(t) for c, t in tokens.items()} == before
    # the pod goes: once the kubelet has written its checkpoint, both records go
    kubelet.release("default", "job")
    kubelet.admit("default", "later", "c", 1)
    assert set(p.daemon.gc_once()) == set(tokens.values())


def test_init_container_alone_holding_a_gpu(kubelet: FakeKubelet, inproc) -> None:
    """An init container with a vGPU whose app containers have none: PodResources never lists
    its vGPU, the record still lives as long as the pod."""
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600)
    kubelet.wait_endpoint()
    a = kubelet.admit_pod("default", "prep", [ContainerSpec("app", 0)], [ContainerSpec("init", 1)])
    kubelet.admit("default", "other", "c", 1)
    _gc_passes(p)
    assert kubelet.recreate_sandbox("default", "prep")["init"].envs[TOKEN_ENV] == a["init"].envs[TOKEN_ENV]
    assert os.path.exists(p.state.allocation_record(a["init"].envs[TOKEN_ENV]))


def test_app_needing_more_than_its_init_container(kubelet: FakeKubelet, inproc) -> None:
    """K4(f): init 1 vGPU, app 2: the app's GetPreferredAllocation must include the init's vGPU."""
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600, device_split_count=4)
    kubelet.wait_endpoint()
    a = kubelet.admit_pod("default", "f", [ContainerSpec("app", 2)], [ContainerSpec("init", 1)])
    assert a["init"].device_ids[0] in a["app"].device_ids and len(a["app"].device_ids) == 2
    kubelet.admit("default", "other", "c", 1)
    _gc_passes(p)
    again = kubelet.recreate_sandbox("default", "f")
    for c in ("init", "app"):
        assert again[c].envs[TOKEN_ENV] == a[c].envs[TOKEN_ENV]
        assert os.path.exists(p.state.allocation_record(a[c].envs[TOKEN_ENV]))


def test_kubelet_restart_keeps_init_container_pods(kubelet: FakeKubelet, inproc) -> None:
    """The restarted kubelet re-admits its pods; an init container (not running) needs a healthy
    device then. The plugin is back (registered, device list sent) within milliseconds of
    kubelet.sock, so the pod is kept and its replayed tokens still have their records."""
    p = inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600)
    kubelet.wait_endpoint()
    a = kubelet.admit_pod("default", "job", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)])
    kubelet.restart()
    kubelet.wait_registration(count=2, timeout=20)
    kubelet.wait_endpoint(timeout=20)
    r = kubelet.readmit()
    assert r.rejected == []
    _gc_passes(p)
    again = kubelet.recreate_sandbox("default", "job")
    assert {c: x.envs[TOKEN_ENV] for c, x in again.items()} == {c: x.envs[TOKEN_ENV] for c, x in a.items()}
    for x in a.values():
        assert os.path.exists(p.state.allocation_record(x.envs[TOKEN_ENV]))


def test_kubelet_sock_accepting_late_still_keeps_init_container_pods(kubelet: FakeKubelet, inproc) -> None:
    """The real kubelet's kubelet.sock exists (bind) before it accepts (listen): on the real
    kubelet v1.36.2 under load the plugin, woken by the file, had its connect refused 32 ms
    after the file appeared, and gRPC's reconnect backoff (1 s +-20 %) registered it 1.01 s
    after - after the kubelet re-admitted its pods (0.84 s), rejecting the init-container pod.
    A refused Register is retried at once, so the plugin is back well before re-admission."""
    inproc(record_gc_grace_s=0.0, record_gc_interval_s=3600)
    kubelet.wait_endpoint()
    kubelet.admit_pod("default", "job", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)])
    t0 = kubelet.restart(listen_after_s=0.3)
    kubelet.wait_registration(count=2, timeout=20)
    assert kubelet.listened_at - t0 >= 0.25  # nothing was accepted before
    # re-admission when the real kubelet does it, whether the plugin is back or not
    time.sleep(max(0.0, t0 + READMIT_AFTER_S - time.monotonic()))
    assert kubelet.readmit().rejected == []


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


def test_systemd_is_told_once_the_plugin_serves(tmp_path: Path, inproc, monkeypatch: pytest.MonkeyPatch) -> None:
    """Type=notify: READY=1 on $NOTIFY_SOCKET once the plugin's socket serves, with or without
    a kubelet (at boot the unit runs before kubelet.service)."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(20)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    try:
        p = inproc()
        assert sock.recv(64) == b"READY=1"
        assert os.path.exists(p.daemon.where.plugin_socket)  # serving when it said so
        with FakeKubelet(tmp_path / "kubelet") as k:
            k.wait_registration(timeout=20)
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(64)  # once
    finally:
        sock.close()


def test_allocate_passes_the_measured_context_size(kubelet: FakeKubelet, inproc) -> None:
    """The monitor's measured context size of the container's GPUs (the largest of them) goes to
    libvgpu.so as VGPU_CONTEXT_RESERVE; without a measurement, no such env (and a bad file is
    no measurement)."""
    from vgpu import contextsizes

    p = inproc(device_split_count=2)
    ep = kubelet.wait_endpoint()
    g0, g1 = (g.uuid for g in synthetic_gpus())
    assert "VGPU_CONTEXT_RESERVE" not in ep.allocate([f"{g0}::0"]).envs  # nothing measured yet

    contextsizes.write(p.state.context_sizes_path, {g0: 300 << 20, g1: 500 << 20, "GPU-other": 900 << 20})
    assert ep.allocate([f"{g0}::1"]).envs["VGPU_CONTEXT_RESERVE"] == str(300 << 20)
    assert ep.allocate([f"{g0}::0", f"{g1}::0"]).envs["VGPU_CONTEXT_RESERVE"] == str(500 << 20)

    contextsizes.write(p.state.context_sizes_path, {g1: 500 << 20})
    assert "VGPU_CONTEXT_RESERVE" not in ep.allocate([f"{g0}::1"]).envs  # its GPU not measured

    Path(p.state.context_sizes_path).write_text('{"version": 1, "gpus": {"' + g0 + '": "lots"}}')
    resp = ep.allocate([f"{g0}::0"])
    assert "VGPU_CONTEXT_RESERVE" not in resp.envs and valid_token(resp.envs[TOKEN_ENV])
