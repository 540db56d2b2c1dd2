"""A kubelet stand-in for device plugin tests and the demo.

It behaves towards a device plugin the way kubelet's device manager does
(k8s pkg/kubelet/cm/devicemanager), over real gRPC on real unix sockets:

- serves `/v1beta1.Registration/Register` on `<root>/device-plugins/kubelet.sock`;
  validates the version and the resource name, answers, and only then (in a
  thread, as kubelet's `go runClient`) dials the plugin's endpoint back, calls
  `GetDevicePluginOptions` and keeps a `ListAndWatch` stream open;
- a new registration for a resource replaces the previous endpoint;
- `admit()` does what kubelet does for one container: free healthy devices,
  `GetPreferredAllocation` when the plugin offers it, then `Allocate` with
  exactly one container request, and it remembers the assignment (checkpoint
  file and PodResources);
- `restart()` simulates a kubelet restart exactly: connections dropped, every
  non-directory entry of the device-plugins dir except the checkpoint
  deleted (plugin sockets included), then kubelet.sock created anew;
- serves PodResources v1 `List` on `<root>/pod-resources/kubelet.sock` from the
  assignments made by `admit()` (or set directly with `assign()`/`release()`).

Typical use::

    with FakeKubelet(tmp_path / "kubelet") as kubelet:
        ...start the plugin with --kubelet-dir tmp_path/"kubelet"...
        ep = kubelet.wait_endpoint("nvidia.com/gpu")
        devices = ep.wait_devices(lambda d: len(d) == 4)
        alloc = kubelet.admit("default", "pod-a", "main", count=1)
        alloc.envs["VGPU_ALLOCATION_TOKEN"]
        t = kubelet.restart(); reg = kubelet.wait_registration(count=2)

All waits take a timeout in seconds and raise TimeoutError when it passes.
Times (`Registration.at`, `PluginEndpoint.first_list_at`, `restart()`) are
`time.monotonic()` values, comparable across processes on one host.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from device_plugin.api import deviceplugin_pb2 as dp
from device_plugin.api import deviceplugin_pb2_grpc as dp_grpc
from device_plugin.api import podresources_pb2 as pr
from device_plugin.api import podresources_pb2_grpc as pr_grpc

__all__ = [
    "CHECKPOINT",
    "ContainerAllocation",
    "Device",
    "FakeKubelet",
    "InsufficientDevices",
    "PluginEndpoint",
    "Registration",
]

SUPPORTED_VERSIONS = ("v1beta1",)
CHECKPOINT = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"


@dataclass(frozen=True)
class Registration:
    """One Register call as the kubelet received it."""

    version: str
    endpoint: str
    resource_name: str
    pre_start_required: bool
    get_preferred_allocation_available: bool
    at: float  # time.monotonic() when kubelet received it


@dataclass(frozen=True)
class Device:
    id: str
    health: str
    numa: tuple[int, ...]  # empty: no topology

    @property
    def healthy(self) -> bool:
        return self.health == HEALTHY


@dataclass(frozen=True)
class ContainerAllocation:
    """The Allocate answer for one container, plus the IDs kubelet chose."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]
    preferred: tuple[str, ...] | None  # GetPreferredAllocation's answer, None when not asked
    envs: dict[str, str]
    annotations: dict[str, str]
    mounts: list[dp.Mount]
    devices: list[dp.DeviceSpec]
    cdi_devices: list[str]


class InsufficientDevices(RuntimeError):
    """Not enough free healthy devices (kubelet: UnexpectedAdmissionError)."""


class PluginEndpoint:
    """Kubelet's client connection to one registered plugin."""

    def __init__(self, device_plugins_dir: str, reg: Registration) -> None:
        self.registration = reg
        self.socket_path = os.path.join(device_plugins_dir, reg.endpoint)
        self.options: dp.DevicePluginOptions | None = None
        self.first_list_at: float | None = None
        self.connect_error: str | None = None
        self.updates = 0  # ListAndWatch responses received
        self.stream_ended = threading.Event()
        self._devices: dict[str, Device] = {}
        self._cond = threading.Condition()
        self._channel: grpc.Channel | None = None
        self._stub: dp_grpc.DevicePluginStub | None = None
        self._stream: grpc.Future | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"endpoint-{reg.endpoint}", daemon=True)
        self._thread.start()

    @property
    def resource_name(self) -> str:
        return self.registration.resource_name

    def _run(self) -> None:
        try:
            ch = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._channel = ch
            self._stub = dp_grpc.DevicePluginStub(ch)
            # kubelet dials with a blocking 10 s connect, then asks for the options.
            self.options = self._stub.GetDevicePluginOptions(dp.Empty(), timeout=10, wait_for_ready=True)
            stream = self._stub.ListAndWatch(dp.Empty())
            self._stream = stream
            for resp in stream:
                devs = {}
                for d in resp.devices:
                    devs[d.ID] = Device(d.ID, d.health, tuple(n.ID for n in d.topology.nodes))
                with self._cond:
                    if self.first_list_at is None:
                        self.first_list_at = time.monotonic()
                    self._devices = devs
                    self.updates += 1
                    self._cond.notify_all()
        except (grpc.RpcError, ValueError) as e:
            if not self._closed:
                self.connect_error = str(e)
        finally:
            self.stream_ended.set()
            with self._cond:
                self._cond.notify_all()

    # --- device list --------------------------------------------------------
    def devices(self) -> dict[str, Device]:
        """The latest ListAndWatch device list (ID → Device)."""
        with self._cond:
            return dict(self._devices)

    def wait_devices(
        self, predicate: Callable[[dict[str, Device]], bool] | None = None, timeout: float = 10.0
    ) -> dict[str, Device]:
        """Wait for a device list (satisfying `predicate`, if given) and return it."""
        deadline = time.monotonic() + timeout

        def ok() -> bool:
            return self.updates > 0 and (predicate is None or predicate(self._devices))

        with self._cond:
            while not ok():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"device list condition not met in {timeout}s (updates={self.updates}, "
                        f"ended={self.stream_ended.is_set()}, error={self.connect_error})"
                    )
                self._cond.wait(left)
            return dict(self._devices)

    def healthy_ids(self) -> list[str]:
        return [d.id for d in self.devices().values() if d.healthy]

    # --- calls kubelet makes ------------------------------------------------
    def _require_stub(self) -> dp_grpc.DevicePluginStub:
        deadline = time.monotonic() + 10
        while self._stub is None:
            if self.stream_ended.is_set() or time.monotonic() > deadline:
                raise ConnectionError(f"not connected to {self.socket_path}: {self.connect_error}")
            time.sleep(0.01)
        return self._stub

    def preferred(self, available: Iterable[str], size: int, must_include: Iterable[str] = ()) -> list[str]:
        """GetPreferredAllocation for one container (as kubelet sends it)."""
        req = dp.PreferredAllocationRequest()
        req.container_requests.add(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
        )
        resp = self._require_stub().GetPreferredAllocation(req, timeout=10)
        return list(resp.container_responses[0].deviceIDs)

    def allocate(self, device_ids: Iterable[str]) -> dp.ContainerAllocateResponse:
        """Allocate with exactly one container request; kubelet reads response [0].

        A refusal raises grpc.RpcError (code() and details() as the plugin set them).
        """
        req = dp.AllocateRequest()
        req.container_requests.add(devices_ids=list(device_ids))
        resp = self._require_stub().Allocate(req, timeout=10)
        if len(resp.container_responses) != 1:
            raise RuntimeError(f"Allocate answered {len(resp.container_responses)} container responses, want 1")
        return resp.container_responses[0]

    def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.cancel()
        if self._channel is not None:
            self._channel.close()
        self._thread.join(timeout=5)


class _Registration(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        return self.kubelet._on_register(request, context)


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        self.kubelet.pod_resources_calls += 1
        return self.kubelet._list_pod_resources()


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _valid_resource_name(name: str) -> bool:
    # kubelet: v1helper.IsExtendedResourceName — `<dns subdomain>/<name>`, not the
    # kubernetes.io domain (native resources), not `requests.*`.
    domain, sep, rest = name.partition("/")
    if not sep or name.startswith("requests.") or domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False
    return (
        len(domain) <= 253
        and bool(_DNS_SUBDOMAIN.match(domain))
        and len(rest) <= 63
        and bool(_QUALIFIED_NAME_PART.match(rest))
    )


@dataclass
class _Assign:
    # (namespace, pod) → container → resource → ids
    pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = field(default_factory=dict)


class FakeKubelet:
    """The stand-in. `root` plays /var/lib/kubelet (pass it as --kubelet-dir)."""

    def __init__(self, root: str | os.PathLike[str], *, pod_resources: bool = True) -> None:
        self.root = Path(root)
        self.device_plugins_dir = str(self.root / "device-plugins")
        self.socket_path = os.path.join(self.device_plugins_dir, "kubelet.sock")
        self.pod_resources_socket = str(self.root / "pod-resources" / "kubelet.sock")
        self.registrations: list[Registration] = []
        self.rejected: list[tuple[dp.RegisterRequest, str]] = []
        self.pod_resources_calls = 0
        self.socket_created_at = 0.0
        self._with_pod_resources = pod_resources
        self._endpoints: dict[str, PluginEndpoint] = {}
        self._assign = _Assign()
        self._cond = threading.Condition()
        self._admit_lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None

    # --- life cycle -----------------------------------------------------------
    def start(self) -> FakeKubelet:
        """Start as kubelet does: make the dir, clean it, serve kubelet.sock (and PodResources)."""
        os.makedirs(self.device_plugins_dir, mode=0o750, exist_ok=True)
        self._cleanup_plugin_dir()
        self._write_checkpoint()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet"))
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot bind {self.socket_path}")
        self.socket_created_at = time.monotonic()  # the file exists from here on
        server.start()
        self._server = server
        if self._with_pod_resources and self._pr_server is None:
            self.start_pod_resources()
        return self

    def start_pod_resources(self) -> None:
        """Serve PodResources v1 on <root>/pod-resources/kubelet.sock."""
        os.makedirs(os.path.dirname(self.pod_resources_socket), exist_ok=True)
        try:
            os.unlink(self.pod_resources_socket)
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="podres"))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._pr_server = server

    def stop_pod_resources(self) -> None:
        if self._pr_server is not None:
            self._pr_server.stop(0).wait(5)
            self._pr_server = None
        try:
            os.unlink(self.pod_resources_socket)
        except FileNotFoundError:
            pass

    def _stop_registration(self) -> None:
        with self._cond:
            eps = list(self._endpoints.values())
            self._endpoints.clear()
        for ep in eps:
            ep.close()
        if self._server is not None:
            self._server.stop(0).wait(5)
            self._server = None

    def stop(self) -> None:
        """Stop everything (kubelet exits); sockets of plugins are left alone."""
        self._stop_registration()
        self.stop_pod_resources()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def restart(self) -> float:
        """Simulate a kubelet restart; returns the time.monotonic() at which kubelet.sock was created.

        Exactly kubelet's sequence: the old process's connections go away, the
        new one runs MkdirAll + CleanupPluginDirectory (every non-directory
        entry but the checkpoint is removed: the plugins' sockets and the old
        kubelet.sock), then creates and serves kubelet.sock.
        """
        self._stop_registration()
        self.start()
        return self.socket_created_at

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _cleanup_plugin_dir(self) -> None:
        for name in os.listdir(self.device_plugins_dir):
            if name == CHECKPOINT:
                continue
            p = os.path.join(self.device_plugins_dir, name)
            try:
                if stat.S_ISDIR(os.lstat(p).st_mode):
                    continue
                os.unlink(p)
            except FileNotFoundError:
                pass

    # --- registration -----------------------------------------------------------
    def _on_register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        at = time.monotonic()
        err = None
        if request.version not in SUPPORTED_VERSIONS:
            err = (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported versions are ["{SUPPORTED_VERSIONS[0]}"]'
            )
        elif not _valid_resource_name(request.resource_name):
            err = f'the ResourceName "{request.resource_name}" is invalid'
        if err is not None:
            with self._cond:
                self.rejected.append((request, err))
                self._cond.notify_all()
            context.abort(grpc.StatusCode.UNKNOWN, err)
        reg = Registration(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            pre_start_required=request.options.pre_start_required,
            get_preferred_allocation_available=request.options.get_preferred_allocation_available,
            at=at,
        )
        threading.Thread(target=self._connect, args=(reg,), daemon=True).start()
        return dp.Empty()

    def _connect(self, reg: Registration) -> None:
        ep = PluginEndpoint(self.device_plugins_dir, reg)
        with self._cond:
            old = self._endpoints.get(reg.resource_name)
            self._endpoints[reg.resource_name] = ep
            self.registrations.append(reg)
            self._cond.notify_all()
        if old is not None:
            old.close()

    def wait_registration(self, count: int = 1, timeout: float = 10.0) -> Registration:
        """Wait until `count` registrations in total were accepted; return the latest."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.registrations) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.registrations)} registrations after {timeout}s, want {count}")
                self._cond.wait(left)
            return self.registrations[-1]

    def endpoint(self, resource_name: str = "nvidia.com/gpu") -> PluginEndpoint:
        with self._cond:
            return self._endpoints[resource_name]

    def wait_endpoint(self, resource_name: str = "nvidia.com/gpu", timeout: float = 10.0) -> PluginEndpoint:
        """The plugin endpoint for a resource once registered and its first device list arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while resource_name not in self._endpoints:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no plugin registered {resource_name} in {timeout}s")
                self._cond.wait(left)
            ep = self._endpoints[resource_name]
        ep.wait_devices(timeout=max(0.1, deadline - time.monotonic()))
        return ep

    # --- device manager ------------------------------------------------------------
    def allocated_ids(self, resource_name: str = "nvidia.com/gpu") -> set[str]:
        with self._cond:
            return {
                d
                for containers in self._assign.pods.values()
                for res in containers.values()
                for d in res.get(resource_name, [])
            }

    def admit(
        self,
        namespace: str,
        pod: str,
        container: str,
        count: int = 1,
        resource_name: str = "nvidia.com/gpu",
    ) -> ContainerAllocation:
        """Admit one container requesting `count` devices, as kubelet's device manager does.

        Raises InsufficientDevices, or grpc.RpcError when the plugin refuses.
        """
        with self._admit_lock:  # kubelet admits pods one at a time
            return self._admit(namespace, pod, container, count, resource_name)

    def _admit(self, namespace: str, pod: str, container: str, count: int, resource_name: str) -> ContainerAllocation:
        ep = self.wait_endpoint(resource_name)
        used = self.allocated_ids(resource_name)
        available = [d for d in sorted(ep.healthy_ids()) if d not in used]
        if count > len(available):
            raise InsufficientDevices(f"requested {count} {resource_name}, available {len(available)}")
        preferred: list[str] | None = None
        chosen: list[str] = []
        if ep.options is not None and ep.options.get_preferred_allocation_available:
            preferred = ep.preferred(available, count)
            chosen = [d for d in preferred if d in available][:count]
        for d in available:  # kubelet fills up from the available set when the answer is short
            if len(chosen) >= count:
                break
            if d not in chosen:
                chosen.append(d)
        resp = ep.allocate(chosen)
        self.assign(namespace, pod, container, chosen, resource_name)
        return ContainerAllocation(
            namespace=namespace,
            pod=pod,
            container=container,
            resource_name=resource_name,
            device_ids=tuple(chosen),
            preferred=tuple(preferred) if preferred is not None else None,
            envs=dict(resp.envs),
            annotations=dict(resp.annotations),
            mounts=list(resp.mounts),
            devices=list(resp.devices),
            cdi_devices=[c.name for c in resp.cdi_devices],
        )

    def assign(
        self, namespace: str, pod: str, container: str, device_ids: Iterable[str], resource_name: str = "nvidia.com/gpu"
    ) -> None:
        """Record devices as assigned to a container (what PodResources will report)."""
        with self._cond:
            res = self._assign.pods.setdefault((namespace, pod), {}).setdefault(container, {})
            res.setdefault(resource_name, []).extend(device_ids)
        self._write_checkpoint()

    def release(self, namespace: str, pod: str) -> None:
        """The pod is gone: its devices are free and PodResources no longer lists it."""
        with self._cond:
            self._assign.pods.pop((namespace, pod), None)
        self._write_checkpoint()

    def pods(self) -> dict[tuple[str, str], dict[str, dict[str, list[str]]]]:
        """A copy of the assignments: (namespace, pod) → container → resource → IDs."""
        with self._cond:
            return {
                k: {c: {r: list(ids) for r, ids in res.items()} for c, res in v.items()}
                for k, v in self._assign.pods.items()
            }

    def _list_pod_resources(self) -> pr.ListPodResourcesResponse:
        resp = pr.ListPodResourcesResponse()
        with self._cond:
            for (ns, name), containers in self._assign.pods.items():
                p = resp.pod_resources.add(name=name, namespace=ns)
                for cname, res in containers.items():
                    c = p.containers.add(name=cname)
                    for rname, ids in res.items():
                        c.devices.add(resource_name=rname, device_ids=ids)
        return resp

    def _write_checkpoint(self) -> None:
        # Same role as kubelet's checkpoint (which survives restarts); the
        # format here is the stand-in's own: pod → container → resource → IDs.
        if not os.path.isdir(self.device_plugins_dir):
            return
        with self._cond:
            data = {
                "PodDeviceEntries": [
                    {"PodUID": f"{ns}/{pod}", "ContainerName": c, "ResourceName": r, "DeviceIDs": ids}
                    for (ns, pod), cs in self._assign.pods.items()
                    for c, res in cs.items()
                    for r, ids in res.items()
                ]
            }
        tmp = os.path.join(self.device_plugins_dir, f".{CHECKPOINT}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, os.path.join(self.device_plugins_dir, CHECKPOINT))
