"""The kubelet stand-in (sim/kubelet.py) against the recorded kubelet v1.36.2.

The K4 recording (tests/data/real-traces/deviceplugin/, README rows K4 a-f) ran a small device
plugin under a real kubelet: 8 devices, PreStartRequired + GetPreferredAllocationAvailable,
Allocate answering `envs {NVIDIA_VISIBLE_DEVICES: <ids>}` and `annotations {vgpu.rec/allocated:
<ids>}`. `RecordingPlugin` here is that plugin, answering GetPreferredAllocation with the recorded
answers in order; the stand-in then has to make the recorded calls (same methods, same IDs,
must-include and sizes), write the recorded checkpoint entries, list what PodResources listed, and
reject at re-admission what the restarted kubelet rejected, with its message.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.json_format import MessageToDict

from device_plugin.api import deviceplugin_pb2 as dp
from device_plugin.api import deviceplugin_pb2_grpc as dp_grpc
from device_plugin.api import podresources_pb2 as pr
from device_plugin.api import podresources_pb2_grpc as pr_grpc
from sim import kubelet_checkpoint as kc
from sim.kubelet import ContainerSpec, FakeKubelet
from tests.support import traces

pytestmark = pytest.mark.timeout(120)

RES = "nvidia.com/gpu"
UID = {  # the recorded pods' UIDs (kubelet_internal_checkpoint.*.json)
    "k4-a": "5534e6da-5243-4729-81a0-6ef6a3830ed3",
    "k4-b": "64c84f40-533f-4761-a733-bbb75d4081a8",
    "k4-e": "f4a37522-12c1-4650-b432-27917b8ef074",
}
REJECTED = (
    "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices nvidia.com/gpu, "
    "which is unexpected"
)


def _calls() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = traces.load_json("deviceplugin/calls.json")
    return out


def _devices() -> list[str]:
    first = next(c for c in _calls() if c["call"] == "ListAndWatch.send")
    return [d["ID"] for d in first["response"]["devices"]]


def _segments() -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Recorded kubelet -> plugin calls that matter to allocation, by scenario MARK."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    cur = "start"
    for c in _calls():
        if c["call"] == "MARK":
            cur = c["mark"].split(":")[0] + (" restart" if "stopped" in c["mark"] else "")
            out.setdefault(cur, [])
        elif c["call"] in ("GetPreferredAllocation", "Allocate", "PreStartContainer"):
            out.setdefault(cur, []).append((c["call"], c["request"]))
    return out


def _norm(calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, Any]]:
    """Order-free within a request: the kubelet sends Go sets (UnsortedList)."""
    out: list[tuple[str, Any]] = []
    for name, req in calls:
        if name == "GetPreferredAllocation":
            r = req["container_requests"][0]
            out.append(
                (
                    name,
                    (
                        sorted(r.get("available_deviceIDs", [])),
                        sorted(r.get("must_include_deviceIDs", [])),
                        r["allocation_size"],
                    ),
                )
            )
        elif name == "Allocate":
            out.append((name, sorted(req["container_requests"][0]["devices_ids"])))
        else:
            out.append((name, sorted(req["devices_ids"])))
    return out


class RecordingPlugin(dp_grpc.DevicePluginServicer):
    """The K4 recording plugin (README): its options, its devices, its Allocate answer."""

    def __init__(self, preferred: list[list[str]]) -> None:
        self.preferred = preferred  # the recorded GetPreferredAllocation answers, consumed in order
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.stop = threading.Event()

    def _record(self, name: str, req: Any) -> None:
        self.calls.append((name, MessageToDict(req, preserving_proto_field_name=True)))

    def GetDevicePluginOptions(self, request: dp.Empty, context: grpc.ServicerContext) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: dp.Empty, context: grpc.ServicerContext) -> Iterator[dp.ListAndWatchResponse]:
        yield dp.ListAndWatchResponse(devices=[dp.Device(ID=d, health="Healthy") for d in _devices()])
        while not self.stop.wait(0.1) and context.is_active():
            pass

    def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> dp.PreferredAllocationResponse:
        self._record("GetPreferredAllocation", request)
        resp = dp.PreferredAllocationResponse()
        resp.container_responses.add(deviceIDs=self.preferred.pop(0))
        return resp

    def Allocate(self, request: dp.AllocateRequest, context: grpc.ServicerContext) -> dp.AllocateResponse:
        self._record("Allocate", request)
        resp = dp.AllocateResponse()
        for c in request.container_requests:
            ids = ",".join(c.devices_ids)
            r = resp.container_responses.add()
            r.envs["NVIDIA_VISIBLE_DEVICES"] = ids
            r.annotations["vgpu.rec/allocated"] = ids
        return resp

    def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> dp.PreStartContainerResponse:
        self._record("PreStartContainer", request)
        return dp.PreStartContainerResponse()


class Plugin:
    """One serving and registered instance of RecordingPlugin (what the recorder re-ran after
    each kubelet restart)."""

    def __init__(self, kubelet: FakeKubelet, servicer: RecordingPlugin) -> None:
        self.servicer = servicer
        sock = os.path.join(kubelet.device_plugins_dir, "vgpu-rec.sock")
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_DevicePluginServicer_to_server(servicer, self.server)
        self.server.add_insecure_port(f"unix://{sock}")
        self.server.start()
        servicer.stop.clear()
        with grpc.insecure_channel(f"unix://{kubelet.socket_path}") as ch:
            dp_grpc.RegistrationStub(ch).Register(
                dp.RegisterRequest(
                    version="v1beta1",
                    endpoint="vgpu-rec.sock",
                    resource_name=RES,
                    options=dp.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True),
                ),
                timeout=10,
            )
        kubelet.wait_endpoint(RES)

    def close(self) -> None:
        self.servicer.stop.set()
        self.server.stop(0).wait(5)


def _recorded_preferred() -> list[list[str]]:
    return [
        c["response"]["container_responses"][0]["deviceIDs"] for c in _calls() if c["call"] == "GetPreferredAllocation"
    ]


def _entries(blob: bytes) -> list[tuple[str, str, str, Any, str]]:
    doc = json.loads(blob)
    return sorted(
        (e["PodUID"], e["ContainerName"], e["ResourceName"], json.dumps(e["DeviceIDs"], sort_keys=True), e["AllocResp"])
        for e in doc["Data"]["PodDeviceEntries"] or []
    )


def _registered(blob: bytes) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in json.loads(blob)["Data"]["RegisteredDevices"].items()}


def _pods(resp: dict[str, Any]) -> list[Any]:
    return sorted(
        (
            p["name"],
            sorted((c["name"], sorted(d["device_ids"][0] for d in c.get("devices", []))) for c in p["containers"]),
        )
        for p in resp.get("pod_resources", [])
    )


def _list(kubelet: FakeKubelet) -> dict[str, Any]:
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as ch:
        resp = pr_grpc.PodResourcesListerStub(ch).List(pr.ListPodResourcesRequest(), timeout=10)
    out: dict[str, Any] = MessageToDict(resp, preserving_proto_field_name=True)
    return out


def test_checkpoint_format_is_the_kubelets(tmp_path: Path) -> None:
    """The three recorded checkpoint files: read back with their checksums verified, written
    again field for field (only the recorder's `_AllocResp_decoded_bytes_repr` note dropped)."""
    for name in ("before-restart", "after-restart", "before-restart2"):
        blob = traces.path(f"deviceplugin/kubelet_internal_checkpoint.{name}.json").read_bytes()
        entries, registered = kc.unmarshal(blob)
        recorded = json.loads(blob)
        for e in recorded["Data"]["PodDeviceEntries"]:
            del e["_AllocResp_decoded_bytes_repr"]
        assert json.dumps(json.loads(kc.marshal(entries, registered))) == json.dumps(recorded)
        assert kc.checksum(entries, registered) == recorded["Checksum"]
        recorded["Checksum"] += 1
        with pytest.raises(kc.CorruptCheckpoint):
            kc.unmarshal(json.dumps(recorded).encode())


def test_a_corrupt_checkpoint_restores_nothing(tmp_path: Path) -> None:
    blob = json.loads(traces.path("deviceplugin/kubelet_internal_checkpoint.before-restart.json").read_bytes())
    blob["Checksum"] += 1
    root = tmp_path / "kubelet"
    (root / "device-plugins").mkdir(parents=True)
    (root / "device-plugins" / "kubelet_internal_checkpoint").write_text(json.dumps(blob))
    with FakeKubelet(root) as k:
        assert k.capacity(RES) is None  # "Continue after failing to read checkpoint file"
        assert k.allocated_ids(RES) == set()


def test_recorded_k4_scenarios(tmp_path: Path) -> None:
    """K4 a-f through the stand-in and the recording plugin: calls, checkpoints, PodResources,
    re-admission after two kubelet restarts."""
    seg = _segments()
    servicer = RecordingPlugin(_recorded_preferred())
    kubelet = FakeKubelet(tmp_path / "kubelet").start()
    plugin = Plugin(kubelet, servicer)
    try:
        kubelet.admit_pod("default", "nogpu-c", [ContainerSpec("main", 0)])

        # (a) one container
        servicer.calls.clear()
        kubelet.admit_pod("default", "k4-a", [ContainerSpec("main", 1)], uid=UID["k4-a"])
        assert _norm(servicer.calls) == _norm(seg["scenario a"])

        # (b) init + app: one GetPreferredAllocation, two Allocate with the same ID, two PreStart
        servicer.calls.clear()
        b = kubelet.admit_pod("default", "k4-b", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)], uid=UID["k4-b"])
        assert _norm(servicer.calls) == _norm(seg["scenario b"])
        assert b["init"].device_ids == b["app"].device_ids

        # (c) the sandbox is killed: no Allocate, only PreStartContainer with the same devices,
        # and the kept answers (init's and app's) again
        servicer.calls.clear()
        again = kubelet.recreate_sandbox("default", "k4-b")
        assert _norm(servicer.calls) == _norm(seg["scenario c"])
        assert {c: a.envs for c, a in again.items()} == {c: a.envs for c, a in b.items()}

        recorded = traces.path("deviceplugin/kubelet_internal_checkpoint.before-restart.json").read_bytes()
        ours = Path(kubelet.checkpoint_path).read_bytes()
        assert _entries(ours) == _entries(recorded)
        assert _registered(ours) == _registered(recorded)
        rec_pr = traces.load_json("deviceplugin/podresources-v1.before-kubelet-restart.json")
        assert _pods(_list(kubelet)) == _pods(rec_pr["List"]["response"])  # init containers not listed

        # (d) kubelet restart: capacity 0 until the plugin is back; re-admission first (the
        # recorded plugin re-registered 0.2 s after it): k4-b (its init container is not
        # running) rejected, k4-a kept, no Allocate
        plugin.close()
        servicer.calls.clear()
        kubelet.restart()
        assert kubelet.capacity(RES) == 0
        r = kubelet.readmit()
        assert [(x.pod, x.reason, x.message) for x in r.rejected] == [("k4-b", "UnexpectedAdmissionError", REJECTED)]
        plugin = Plugin(kubelet, servicer)
        assert kubelet.capacity(RES) == 8
        assert servicer.calls == []
        rec_pr = traces.load_json("deviceplugin/podresources-v1.after-kubelet-restart.json")
        assert _pods(_list(kubelet)) == _pods(rec_pr["List"]["response"])
        recorded = traces.path("deviceplugin/kubelet_internal_checkpoint.after-restart.json").read_bytes()
        assert _entries(Path(kubelet.checkpoint_path).read_bytes()) == _entries(recorded)  # k4-b's kept

        # (e) init + app again, then the 2nd restart: rejected again
        servicer.calls.clear()
        kubelet.admit_pod("default", "k4-e", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)], uid=UID["k4-e"])
        assert _norm(servicer.calls) == _norm(seg["scenario e"])
        recorded = traces.path("deviceplugin/kubelet_internal_checkpoint.before-restart2.json").read_bytes()
        assert _entries(Path(kubelet.checkpoint_path).read_bytes()) == _entries(recorded)  # k4-b's gone
        plugin.close()
        servicer.calls.clear()
        kubelet.restart()
        r = kubelet.readmit()
        assert [(x.pod, x.message) for x in r.rejected] == [("k4-e", REJECTED)]
        plugin = Plugin(kubelet, servicer)
        kubelet.admit_pod("default", "k5-cuda", [ContainerSpec("cuda", 1)])
        assert _norm(servicer.calls) == _norm(seg["scenario e restart"])

        # (f) init 1, app 2: the app's request must include the init's device
        servicer.calls.clear()
        f = kubelet.admit_pod("default", "k4-f", [ContainerSpec("app", 2)], [ContainerSpec("init", 1)])
        assert _norm(servicer.calls) == _norm(seg["scenario f"])
        assert set(f["init"].device_ids) < set(f["app"].device_ids)
        rec_pr = traces.load_json("deviceplugin/podresources-v1.k4-f.json")
        assert _pods(_list(kubelet)) == _pods(rec_pr["List"]["response"])
    finally:
        plugin.close()
        kubelet.stop()


def test_node_reboot_replays_every_container_once_the_plugin_is_back(tmp_path: Path) -> None:
    """After a reboot nothing runs: every container of a device resource needs healthy devices
    at re-admission (manager.go devicesToAllocate, scenario 3), then starts with its kept answer
    - no Allocate."""
    servicer = RecordingPlugin(_recorded_preferred())
    kubelet = FakeKubelet(tmp_path / "kubelet").start()
    plugin = Plugin(kubelet, servicer)
    try:
        b = kubelet.admit_pod("default", "b", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)])
        plugin.close()
        kubelet.restart(node_reboot=True)
        plugin = Plugin(kubelet, servicer)
        servicer.calls.clear()
        r = kubelet.readmit()
        assert r.rejected == []
        assert [n for n, _ in servicer.calls] == ["PreStartContainer", "PreStartContainer"]
        assert {c: a.envs for c, a in r.started[("default", "b")].items()} == {c: a.envs for c, a in b.items()}
    finally:
        plugin.close()
        kubelet.stop()


def test_kubelet_cleans_only_sockets_from_the_plugin_dir(tmp_path: Path) -> None:
    """manager.go CleanupPluginDirectory: sockets go; directories, regular files and the
    checkpoint stay."""
    import socket

    d = tmp_path / "kubelet" / "device-plugins"
    (d / "sub").mkdir(parents=True)
    (d / "DEPRECATION").write_text("")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "old.sock"))
    s.close()
    with FakeKubelet(tmp_path / "kubelet"):
        assert sorted(os.listdir(d)) == ["DEPRECATION", "kubelet.sock", "sub"]


def test_kubelet_sock_exists_before_it_accepts(tmp_path: Path) -> None:
    """plugin/v1beta1/server.go `Start`: `net.Listen("unix", ...)` binds - kubelet.sock appears -
    and then listens (Go net/sock_posix.go `listenStream`); a connect in between is refused (seen
    on the real kubelet: a plugin's connect refused 32 ms after the file appeared). The stand-in
    stretches that moment with `listen_after_s`; once it listens a plugin registers through it."""
    import socket
    import stat
    import time

    kubelet = FakeKubelet(tmp_path / "kubelet").start(listen_after_s=1.0)
    plugin = None
    try:
        assert stat.S_ISSOCK(os.stat(kubelet.socket_path).st_mode)
        with socket.socket(socket.AF_UNIX) as s, pytest.raises(ConnectionRefusedError):
            s.connect(kubelet.socket_path)
        assert kubelet.listened_at == 0
        deadline = time.monotonic() + 10
        while not kubelet.listened_at:
            assert time.monotonic() < deadline, "kubelet.sock never listened"
            time.sleep(0.02)
        assert kubelet.listened_at - kubelet.socket_created_at >= 0.9
        plugin = Plugin(kubelet, RecordingPlugin(_recorded_preferred()))
        assert [r.endpoint for r in kubelet.registrations] == ["vgpu-rec.sock"]
        assert len(kubelet.endpoint(RES).devices()) == len(_devices())
    finally:
        if plugin is not None:
            plugin.close()
        kubelet.stop()
