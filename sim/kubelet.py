"""A kubelet stand-in for device plugin tests and the demo.

It behaves towards a device plugin the way kubelet v1.36's device manager does
(pkg/kubelet/cm/devicemanager; file and function cited beside each behaviour), over real gRPC on
real unix sockets, and it is checked against the recorded kubelet (tests/device_plugin/test_kubelet_model.py
replays the K4 traces under tests/data/real-traces/deviceplugin/):

- registration (plugin/v1beta1/server.go `Register`): validates the version and the resource
  name, dials the plugin back and asks GetDevicePluginOptions *before* answering (an error there
  fails the plugin's Register), then keeps a ListAndWatch stream open; a new registration for a
  resource replaces the old client;
- the device manager: pods admitted container by container, init containers first
  (topologymanager/scope.go `admitPolicyNone`), the init containers' devices reused by the app
  containers (manager.go `Allocate`, `devicesToReuse`), `devicesToAllocate`'s checks and messages,
  GetPreferredAllocation with must-include IDs, one Allocate per container, the answers kept per
  pod UID and container (pod_devices.go) and replayed - never asked again - when a container
  (re)starts (`GetDeviceRunContainerOptions`), PreStartContainer when the plugin asked for it;
- the checkpoint file `<root>/device-plugins/kubelet_internal_checkpoint` in kubelet's exact
  format (sim/kubelet_checkpoint.py), written when kubelet writes it;
- a kubelet restart: connections dropped, the checkpoint read back (every resource in it
  registered with no healthy device: capacity 0 until the plugin is back), plugin sockets
  deleted, kubelet.sock created anew; `readmit()` then re-admits every pod as the restarted
  kubelet does (running containers are skipped, the others need a healthy device: an init
  container's pod is rejected while the plugin is not back); `node_reboot=True` as after a reboot;
- PodResources v1 `List`, `Get`, `GetAllocatableResources` on `<root>/pod-resources/kubelet.sock`
  (apis/podresources/server_v1.go): init containers are not listed, one entry per device.

Typical use::

    with FakeKubelet(tmp_path / "kubelet") as kubelet:
        ...start the plugin with --kubelet-dir tmp_path/"kubelet"...
        ep = kubelet.wait_endpoint("nvidia.com/gpu")
        devices = ep.wait_devices(lambda d: len(d) == 4)
        alloc = kubelet.admit("default", "pod-a", "main", count=1)
        allocs = kubelet.admit_pod("default", "pod-b", [ContainerSpec("app", 1)], [ContainerSpec("init", 1)])
        replayed = kubelet.recreate_sandbox("default", "pod-b")   # same answers, no Allocate
        t = kubelet.restart(); reg = kubelet.wait_registration(count=2); kubelet.readmit()

All waits take a timeout in seconds and raise TimeoutError when it passes.
Times (`Registration.at`, `PluginEndpoint.first_list_at`, `restart()`) are
`time.monotonic()` values, comparable across processes on one host.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from device_plugin.api import deviceplugin_pb2 as dp
from device_plugin.api import deviceplugin_pb2_grpc as dp_grpc
from device_plugin.api import podresources_pb2 as pr
from device_plugin.api import podresources_pb2_grpc as pr_grpc
from sim import kubelet_checkpoint as ckpt

__all__ = [
    "CHECKPOINT",
    "AdmissionError",
    "ContainerAllocation",
    "ContainerSpec",
    "Device",
    "FakeKubelet",
    "InsufficientDevices",
    "PluginEndpoint",
    "Readmission",
    "Registration",
    "Rejection",
]

SUPPORTED_VERSIONS = ("v1beta1",)
CHECKPOINT = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
NO_TOPOLOGY = -1  # manager.go nodeWithoutTopology
# What the recorded kubelet took from starting its registration server to re-admitting the
# pods it found (kubelet-log-excerpts.txt: 0.842 s and 0.852 s); a plugin that is registered and
# has sent its device list by then keeps its init-container pods.
READMIT_AFTER_S = 0.84


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
class ContainerSpec:
    """A container of a pod: its `limits[resource]` and, for init containers, restartPolicy."""

    name: str
    devices: int = 0
    restartable: bool = False  # an init container with restartPolicy: Always (a sidecar)


@dataclass(frozen=True)
class ContainerAllocation:
    """What a container gets from the device manager when it starts (the kept Allocate answer),
    plus the IDs kubelet chose. `preferred` is GetPreferredAllocation's answer when it was asked
    for this container now, None otherwise (a replay, or devices reused from an init container)."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]
    preferred: tuple[str, ...] | None
    envs: dict[str, str]
    annotations: dict[str, str]
    mounts: list[dp.Mount]
    devices: list[dp.DeviceSpec]
    cdi_devices: list[str]


@dataclass(frozen=True)
class Rejection:
    """A pod the kubelet refused at admission (its status: Failed, reason UnexpectedAdmissionError)."""

    namespace: str
    pod: str
    uid: str
    reason: str
    message: str


@dataclass(frozen=True)
class Readmission:
    """What `readmit()` did: pods refused, and the allocations of containers it started."""

    rejected: list[Rejection]
    started: dict[tuple[str, str], dict[str, ContainerAllocation]]


class AdmissionError(RuntimeError):
    """The device manager refused a container: the pod is rejected (UnexpectedAdmissionError)."""


class InsufficientDevices(AdmissionError):
    """Not enough free healthy devices."""


@dataclass
class _Pod:
    namespace: str
    name: str
    uid: str
    resource: str
    init: tuple[ContainerSpec, ...]
    containers: tuple[ContainerSpec, ...]
    active: bool = True  # in the kubelet's activePods (not deleted, not failed)
    running: set[str] = field(default_factory=set)  # the runtime's running containers


@dataclass
class _Alloc:
    """pod_devices.go deviceAllocateInfo: the devices by NUMA node and the kept answer."""

    devices: dict[int, list[str]]
    resp: bytes | None


def _go_code(code: grpc.StatusCode) -> str:
    # google.golang.org/grpc/codes Code.String(): "InvalidArgument", "Unknown", "Canceled", ...
    name = code.name.title().replace("_", "")
    return "Canceled" if name == "Cancelled" else name


class PluginEndpoint:
    """Kubelet's client connection to one registered plugin (plugin/v1beta1/client.go).

    The constructor is `Connect`: dial (blocking, 10 s) and GetDevicePluginOptions; it raises
    when either fails. `start()` is `Run`: the ListAndWatch stream in a thread.
    """

    def __init__(
        self,
        device_plugins_dir: str,
        reg: Registration,
        on_update: Callable[[PluginEndpoint, dict[str, Device]], None] | None = None,
        on_end: Callable[[PluginEndpoint], None] | None = None,
    ) -> None:
        self.registration = reg
        self.socket_path = os.path.join(device_plugins_dir, reg.endpoint)
        self.first_list_at: float | None = None
        self.connect_error: str | None = None
        self.updates = 0  # ListAndWatch responses received
        self.stream_ended = threading.Event()
        self._on_update = on_update
        self._on_end = on_end
        self._devices: dict[str, Device] = {}
        self._cond = threading.Condition()
        self._stream: grpc.Future | None = None
        self._closed = False
        self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
        self._stub = dp_grpc.DevicePluginStub(self._channel)
        try:
            # client.go dial: grpc.WithBlock, 10 s; then manager.go PluginConnected asks the options.
            self.options: dp.DevicePluginOptions = self._stub.GetDevicePluginOptions(
                dp.Empty(), timeout=10, wait_for_ready=True
            )
        except grpc.RpcError:
            self._channel.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"endpoint-{reg.endpoint}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def resource_name(self) -> str:
        return self.registration.resource_name

    def _run(self) -> None:
        try:
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
                if self._on_update is not None and not self._closed:
                    self._on_update(self, devs)
        except (grpc.RpcError, ValueError) as e:
            if not self._closed:
                self.connect_error = str(e)
        finally:
            self.stream_ended.set()
            with self._cond:
                self._cond.notify_all()
            if self._on_end is not None and not self._closed:
                self._on_end(self)

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

    # --- calls kubelet makes (endpoint.go) ---------------------------------------
    def preferred(self, available: Iterable[str], size: int, must_include: Iterable[str] = ()) -> list[str]:
        """GetPreferredAllocation for one container (as kubelet sends it)."""
        req = dp.PreferredAllocationRequest()
        req.container_requests.add(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size
        )
        resp = self._stub.GetPreferredAllocation(req, timeout=10)
        return list(resp.container_responses[0].deviceIDs) if resp.container_responses else []

    def allocate(self, device_ids: Iterable[str]) -> dp.ContainerAllocateResponse:
        """Allocate with exactly one container request; kubelet keeps response [0].

        A refusal raises grpc.RpcError (code() and details() as the plugin set them).
        """
        req = dp.AllocateRequest()
        req.container_requests.add(devices_ids=list(device_ids))
        resp = self._stub.Allocate(req, timeout=10)
        if len(resp.container_responses) == 0:
            # manager.go allocateContainerResources
            raise AdmissionError(f"no containers return in allocation response {resp}")
        return resp.container_responses[0]

    def pre_start(self, device_ids: Iterable[str]) -> None:
        """PreStartContainer (pluginapi.KubeletPreStartContainerRPCTimeoutInSecs = 30)."""
        self._stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=list(device_ids)), timeout=30)

    def close(self) -> None:
        self._closed = True
        if self._stream is not None:
            self._stream.cancel()
        self._channel.close()
        if self._thread.is_alive():
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

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        res = self.kubelet._get_pod_resources(request.pod_namespace, request.pod_name)
        if res is None:
            # server_v1.go Get
            context.abort(
                grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            )
        return pr.GetPodResourcesResponse(pod_resources=res)

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        return self.kubelet._allocatable_resources()


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


class _LateListener:
    """kubelet.sock as the real kubelet makes it: the file exists (bound) before the socket
    listens. Go's `net.Listen("unix", ...)` (plugin/v1beta1/server.go `Start`) is socket(2),
    bind(2) - the file appears, inotify reports it - then listen(2) (net/sock_posix.go
    `listenStream`); a connect between the two is refused (ECONNREFUSED). Recorded on the real
    kubelet v1.36.2 under CPU load: our plugin's connect refused 32 ms after the file appeared
    (docs/developers/device-plugin.md, "Verified on the real kubelet"). Here bind happens at once and listen
    `listen_after_s` later; accepted connections are relayed byte for byte to the gRPC server,
    which serves a private socket outside the watched directory."""

    def __init__(self, path: str, listen_after_s: float) -> None:
        self.path = path
        self._dir = tempfile.mkdtemp(prefix="kl-")  # short: sun_path holds 108 bytes
        self.inner_path = os.path.join(self._dir, "grpc.sock")
        self.bound_at = self.listened_at = 0.0
        self._delay = listen_after_s
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def bind(self) -> None:
        self._sock.bind(self.path)
        self.bound_at = time.monotonic()
        threading.Thread(target=self._serve, name="kubelet-late-listen", daemon=True).start()

    def _serve(self) -> None:
        if self._closed.wait(self._delay):
            return
        try:
            self._sock.listen(64)
        except OSError:
            return
        self.listened_at = time.monotonic()
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            inner = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                inner.connect(self.inner_path)
            except OSError:
                conn.close()
                inner.close()
                continue
            with self._lock:
                self._conns += [conn, inner]
            for a, b in ((conn, inner), (inner, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class FakeKubelet:
    """The stand-in. `root` plays /var/lib/kubelet (pass it as --kubelet-dir)."""

    def __init__(self, root: str | os.PathLike[str], *, pod_resources: bool = True) -> None:
        self.root = Path(root)
        self.device_plugins_dir = str(self.root / "device-plugins")
        self.socket_path = os.path.join(self.device_plugins_dir, "kubelet.sock")
        self.checkpoint_path = os.path.join(self.device_plugins_dir, CHECKPOINT)
        self.pod_resources_socket = str(self.root / "pod-resources" / "kubelet.sock")
        self.registrations: list[Registration] = []
        self.rejected: list[tuple[dp.RegisterRequest, str]] = []
        self.rejections: list[Rejection] = []  # pods refused at admission
        self.pod_resources_calls = 0
        self.checkpoint_writes = 0
        self.socket_created_at = 0.0
        self._with_pod_resources = pod_resources
        self._endpoints: dict[str, PluginEndpoint] = {}
        # What the API server holds (survives kubelet restarts): pod UID -> pod, in creation order.
        self._pods: dict[str, _Pod] = {}
        # The device manager's memory (lost on restart, rebuilt from the checkpoint).
        self._pod_devices: dict[str, dict[str, dict[str, _Alloc]]] = {}
        self._healthy: dict[str, set[str]] = {}
        self._unhealthy: dict[str, set[str]] = {}
        self._all_devices: dict[str, dict[str, Device]] = {}
        self._reuse: dict[str, dict[str, set[str]]] = {}
        self._sources_ready = True
        self._preferred_now: dict[tuple[str, str], tuple[str, ...] | None] = {}
        self._cond = threading.Condition()
        self._admit_lock = threading.RLock()
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._readmit_timer: threading.Timer | None = None
        self._late: _LateListener | None = None
        self._listened_at = 0.0

    # --- life cycle -----------------------------------------------------------
    def start(self, *, listen_after_s: float = 0.0) -> FakeKubelet:
        """Start as kubelet does (manager.go `Start`, plugin/v1beta1/server.go `Start`): read the
        checkpoint, make the dir, remove the plugin sockets in it, serve kubelet.sock (and
        PodResources). `listen_after_s`: kubelet.sock exists that long before it accepts
        connections (`_LateListener`: the real kubelet's bind-then-listen, stretched)."""
        self._read_checkpoint()
        os.makedirs(self.device_plugins_dir, mode=0o750, exist_ok=True)
        self._cleanup_plugin_dir()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet"))
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        late = _LateListener(self.socket_path, listen_after_s) if listen_after_s > 0 else None
        address = late.inner_path if late is not None else self.socket_path
        if server.add_insecure_port(f"unix://{address}") == 0:
            if late is not None:
                late.close()
            raise OSError(f"cannot bind {address}")
        if late is not None:
            server.start()
            late.bind()
            self.socket_created_at = late.bound_at  # the file exists from here on
            self._late = late
        else:
            self.socket_created_at = time.monotonic()  # the file exists from here on
            server.start()
            self._listened_at = self.socket_created_at
        self._server = server
        if self._with_pod_resources and self._pr_server is None:
            self.start_pod_resources()
        return self

    @property
    def listened_at(self) -> float:
        """time.monotonic() when kubelet.sock began to accept connections (0 while it does not)."""
        return self._late.listened_at if self._late is not None else self._listened_at

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
        if self._readmit_timer is not None:
            self._readmit_timer.cancel()
            self._readmit_timer = None
        with self._cond:
            eps = list(self._endpoints.values())
            self._endpoints.clear()
        for ep in eps:
            ep.close()
        if self._late is not None:
            self._listened_at = self._late.listened_at
            self._late.close()
            self._late = None
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

    def restart(
        self, *, node_reboot: bool = False, readmit_after_s: float | None = None, listen_after_s: float = 0.0
    ) -> float:
        """Simulate a kubelet restart; returns the time.monotonic() at which kubelet.sock was created.

        Exactly kubelet's sequence: the old process's connections go away and its memory with
        them; the new one reads the checkpoint back (manager.go `readCheckpoint`: the kept
        answers, and every resource in it registered with no healthy device - capacity 0 until
        its plugin is back), runs MkdirAll + CleanupPluginDirectory (plugin sockets and the old
        kubelet.sock removed) and serves kubelet.sock. The pods stay (they are the API server's);
        after a kubelet restart their running containers still run, after a node reboot
        (`node_reboot`) none does. Pods are re-admitted by `readmit()` - by the caller, or on a
        timer `readmit_after_s` after kubelet.sock appears as the real kubelet does
        (`READMIT_AFTER_S` in the recording). `listen_after_s`: kubelet.sock exists that long
        before it accepts connections (see `start`).
        """
        self._stop_registration()
        with self._cond:
            self._pod_devices.clear()
            self._healthy.clear()
            self._unhealthy.clear()
            self._all_devices.clear()
            self._reuse.clear()
            self._sources_ready = False  # config.SourcesReady: not all ready until the pods came in
            if node_reboot:
                for p in self._pods.values():
                    p.running.clear()
        self.start(listen_after_s=listen_after_s)
        if readmit_after_s is not None:
            self._readmit_timer = threading.Timer(readmit_after_s, self.readmit)
            self._readmit_timer.daemon = True
            self._readmit_timer.start()
        return self.socket_created_at

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _cleanup_plugin_dir(self) -> None:
        # manager.go CleanupPluginDirectory: os.Stat (follows links); directories, non-sockets
        # and the checkpoint stay; every socket is removed.
        for name in os.listdir(self.device_plugins_dir):
            p = os.path.join(self.device_plugins_dir, name)
            if p == self.checkpoint_path:
                continue
            try:
                mode = os.stat(p).st_mode
            except OSError:
                continue
            if stat.S_ISDIR(mode) or not stat.S_ISSOCK(mode):
                continue
            try:
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
        reg = Registration(
            version=request.version,
            endpoint=request.endpoint,
            resource_name=request.resource_name,
            pre_start_required=request.options.pre_start_required,
            get_preferred_allocation_available=request.options.get_preferred_allocation_available,
            at=at,
        )
        ep = None
        if err is None:
            # server.go Register -> connectClient: the client is registered, dialled and asked
            # for its options before Register returns (the trace: GetDevicePluginOptions arrives
            # before the plugin's Register call returns); a failure is the plugin's error.
            try:
                ep = PluginEndpoint(self.device_plugins_dir, reg, self._on_devices, self._on_stream_end)
            except grpc.RpcError as e:
                err = f"failed to dial device plugin: {e.details() if hasattr(e, 'details') else e}"
        if err is not None or ep is None:
            with self._cond:
                self.rejected.append((request, str(err)))
                self._cond.notify_all()
            context.abort(grpc.StatusCode.UNKNOWN, str(err))
        with self._cond:
            old = self._endpoints.get(reg.resource_name)
            self._endpoints[reg.resource_name] = ep
            self.registrations.append(reg)
            self._cond.notify_all()
        if old is not None:
            old.close()
        ep.start()  # go runClient: ListAndWatch
        return dp.Empty()

    def _on_devices(self, ep: PluginEndpoint, devs: dict[str, Device]) -> None:
        # manager.go genericDeviceUpdateCallback: healthy/unhealthy sets from the list, then
        # writeCheckpoint.
        with self._cond:
            if self._endpoints.get(ep.resource_name) is not ep:
                return
            self._all_devices[ep.resource_name] = dict(devs)
            self._healthy[ep.resource_name] = {i for i, d in devs.items() if d.healthy}
            self._unhealthy[ep.resource_name] = {i for i, d in devs.items() if not d.healthy}
        self._write_checkpoint()

    def _on_stream_end(self, ep: PluginEndpoint) -> None:
        # handler.go runClient -> disconnectClient -> manager.go PluginDisconnected ->
        # markResourceUnhealthy: every device of the resource unhealthy until the plugin is back.
        with self._cond:
            if self._endpoints.get(ep.resource_name) is not ep:
                return
            del self._endpoints[ep.resource_name]
            res = ep.resource_name
            self._unhealthy[res] = self._unhealthy.get(res, set()) | self._healthy.get(res, set())
            self._healthy[res] = set()
            self._cond.notify_all()

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

    def capacity(self, resource_name: str = "nvidia.com/gpu") -> int | None:
        """The node's capacity as GetCapacity reports it (healthy + unhealthy), None if unknown."""
        with self._cond:
            if resource_name not in self._healthy:
                return None
            return len(self._healthy[resource_name]) + len(self._unhealthy.get(resource_name, set()))

    # --- pods ---------------------------------------------------------------------
    def add_pod(
        self,
        namespace: str,
        name: str,
        containers: Sequence[ContainerSpec],
        init_containers: Sequence[ContainerSpec] = (),
        *,
        uid: str | None = None,
        resource_name: str = "nvidia.com/gpu",
        running: Iterable[str] | None = None,
    ) -> str:
        """A pod bound to this node that this kubelet has not admitted (yet): what a restarted
        kubelet finds. `running`: its containers the runtime runs (default: the app containers
        and the restartable init containers, as for a pod admitted before). Returns the UID."""
        pod = _Pod(
            namespace=namespace,
            name=name,
            uid=uid or str(uuid.uuid4()),
            resource=resource_name,
            init=tuple(init_containers),
            containers=tuple(containers),
        )
        pod.running = set(running) if running is not None else self._running_after_start(pod)
        with self._cond:
            if self._find(namespace, name) is not None:
                raise ValueError(f"pod {namespace}/{name} exists")
            self._pods[pod.uid] = pod
        return pod.uid

    def _settle(self, resource_name: str) -> None:
        # A stand-in convenience, not kubelet behaviour: a test admits a pod right after the
        # plugin registered, before its first device list may have arrived; the wait keeps such
        # tests deterministic (kubelet would just see no healthy device yet).
        with self._cond:
            ep = self._endpoints.get(resource_name)
        if ep is not None:
            ep.wait_devices(timeout=10)

    @staticmethod
    def _running_after_start(pod: _Pod) -> set[str]:
        # Init containers ran to completion; sidecars (restartable init containers) and the
        # app containers run.
        return {c.name for c in pod.init if c.restartable} | {c.name for c in pod.containers}

    def _find(self, namespace: str, name: str) -> _Pod | None:
        for p in self._pods.values():
            if (p.namespace, p.name) == (namespace, name) and p.active:
                return p
        return None

    def _pod(self, namespace: str, name: str) -> _Pod:
        p = self._find(namespace, name)
        if p is None:
            raise KeyError(f"no active pod {namespace}/{name}")
        return p

    def admit_pod(
        self,
        namespace: str,
        name: str,
        containers: Sequence[ContainerSpec],
        init_containers: Sequence[ContainerSpec] = (),
        *,
        uid: str | None = None,
        resource_name: str = "nvidia.com/gpu",
    ) -> dict[str, ContainerAllocation]:
        """A new pod, admitted and started as kubelet does: Allocate for every container (init
        containers first), then each container started in order with its kept answer
        (PreStartContainer first when the plugin asked for it). Returns container -> allocation
        for the containers that got devices.

        Raises AdmissionError (the pod is rejected: `rejections`), or grpc.RpcError when the
        plugin refused (also a rejection)."""
        with self._admit_lock:  # kubelet admits pods one at a time
            self._settle(resource_name)
            pod_uid = self.add_pod(
                namespace, name, containers, init_containers, uid=uid, resource_name=resource_name, running=()
            )
            pod = self._pods[pod_uid]
            self._admit(pod)
            out = self._start_containers(pod, [*pod.init, *pod.containers])
            pod.running = self._running_after_start(pod)
            return out

    def admit(
        self,
        namespace: str,
        pod: str,
        container: str,
        count: int = 1,
        resource_name: str = "nvidia.com/gpu",
        *,
        uid: str | None = None,
    ) -> ContainerAllocation:
        """Admit a pod whose one (app) container requests `count` devices; a further call for
        the same pod adds another app container to it. `uid`: the pod's UID in the API (the real
        kubelet admits the API's pods under their UIDs; default: a new one). Raises
        InsufficientDevices, or grpc.RpcError when the plugin refuses."""
        with self._admit_lock:
            p = self._find(namespace, pod)
            if p is None:
                allocs = self.admit_pod(
                    namespace, pod, [ContainerSpec(container, count)], uid=uid, resource_name=resource_name
                )
                return allocs[container]
            self._settle(resource_name)
            spec = ContainerSpec(container, count)
            p.containers = (*p.containers, spec)
            self._admit(p, [spec])
            out = self._start_containers(p, [spec])
            p.running.add(container)
            return out[container]

    def release(self, namespace: str, pod: str) -> None:
        """The pod is deleted: no longer active. As in kubelet, its devices are freed at the next
        `UpdateAllocatedDevices` (an admission, a PodResources call) and its checkpoint entries
        go at the next checkpoint write (an allocation, a device list update), not now."""
        with self._cond:
            p = self._find(namespace, pod)
            if p is not None:
                p.active = False
                p.running.clear()

    def recreate_sandbox(self, namespace: str, name: str) -> dict[str, ContainerAllocation]:
        """The pod's sandbox died (pause killed, node reboot): kuberuntime SyncPod kills the pod
        and starts it in a new sandbox, init containers again first. No Allocate: every
        container gets its kept answer (the same token), after PreStartContainer when asked."""
        with self._admit_lock:
            pod = self._pod(namespace, name)
            pod.running.clear()
            out = self._start_containers(pod, [*pod.init, *pod.containers])
            pod.running = self._running_after_start(pod)
            return out

    def restart_container(self, namespace: str, name: str, container: str) -> ContainerAllocation | None:
        """One container restarts (crash, liveness): its kept answer again, no Allocate."""
        with self._admit_lock:
            pod = self._pod(namespace, name)
            spec = next(c for c in (*pod.init, *pod.containers) if c.name == container)
            return self._start_containers(pod, [spec]).get(container)

    def readmit(self) -> Readmission:
        """What a restarted kubelet does with the pods it finds (kubelet.go HandlePodAdditions ->
        canAdmitPod -> topologymanager admitPolicyNone -> manager.go Allocate for every
        container): while the config sources are not all ready, `devicesToAllocate` skips a
        container the runtime reports running; any other container of a device resource needs
        the resource's healthy devices - with the plugin not back yet that is "no healthy devices
        present" and the pod is rejected and its containers stopped. Containers not running are
        then started with their kept answers (after a node reboot: all of them)."""
        rejected: list[Rejection] = []
        started: dict[tuple[str, str], dict[str, ContainerAllocation]] = {}
        with self._admit_lock:
            before = len(self.rejections)
            for pod in [p for p in self._pods.values() if p.active]:
                try:
                    self._admit(pod)
                except (AdmissionError, grpc.RpcError):
                    continue
                todo = [c for c in (*pod.init, *pod.containers) if c.name not in pod.running]
                if todo:
                    if any(c.name in pod.running for c in pod.containers):
                        todo = [c for c in todo if c not in pod.init or c.restartable]
                    started[(pod.namespace, pod.name)] = self._start_containers(pod, todo)
                    pod.running = self._running_after_start(pod)
            self._sources_ready = True
            rejected = self.rejections[before:]
        return Readmission(rejected=rejected, started=started)

    def pods(self) -> dict[tuple[str, str], dict[str, dict[str, list[str]]]]:
        """(namespace, pod) → container → resource → IDs, of the active pods (init containers too)."""
        with self._cond:
            out: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
            for p in self._pods.values():
                if not p.active:
                    continue
                out[(p.namespace, p.name)] = {
                    c: {r: [d for ids in a.devices.values() for d in ids] for r, a in res.items()}
                    for c, res in self._pod_devices.get(p.uid, {}).items()
                }
            return out

    def allocated_ids(self, resource_name: str = "nvidia.com/gpu") -> set[str]:
        """The devices the device manager holds (manager.go allocatedDevices)."""
        with self._cond:
            return self._allocated(resource_name)

    # --- device manager (manager.go) ------------------------------------------------------
    def _allocated(self, resource: str) -> set[str]:
        # pod_devices.go devices(): entries with a kept answer
        return {
            d
            for conts in self._pod_devices.values()
            for res in conts.values()
            for r, a in res.items()
            if r == resource and a.resp is not None
            for ids in a.devices.values()
            for d in ids
        }

    def _container_devices(self, uid: str, container: str, resource: str) -> set[str] | None:
        a = self._pod_devices.get(uid, {}).get(container, {}).get(resource)
        return None if a is None else {d for ids in a.devices.values() for d in ids}

    def _update_allocated_devices(self) -> None:
        # manager.go UpdateAllocatedDevices: forget the pods that are no longer active (only
        # once the sources are ready); the checkpoint changes at the next write.
        with self._cond:
            if not self._sources_ready:
                return
            for uid in list(self._pod_devices):
                p = self._pods.get(uid)
                if p is None or not p.active:
                    del self._pod_devices[uid]

    def _admit(self, pod: _Pod, only: Sequence[ContainerSpec] | None = None) -> None:
        """topologymanager/scope.go admitPolicyNone: Allocate for each container, init first;
        the first error rejects the pod (admission/errors.go: "Allocate failed due to %v, which
        is unexpected")."""
        for c in only if only is not None else [*pod.init, *pod.containers]:
            try:
                self._allocate(pod, c)
            except AdmissionError as e:
                self._reject(pod, str(e))
                raise
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                details = e.details() if hasattr(e, "details") else str(e)
                self._reject(pod, f"rpc error: code = {_go_code(code)} desc = {details}")
                raise

    def _reject(self, pod: _Pod, err: str) -> None:
        with self._cond:
            pod.active = False  # status Failed: out of activePods
            pod.running.clear()  # "Killing: Stopping container ..."
            self.rejections.append(
                Rejection(
                    pod.namespace,
                    pod.name,
                    pod.uid,
                    "UnexpectedAdmissionError",
                    f"Allocate failed due to {err}, which is unexpected",
                )
            )

    def _allocate(self, pod: _Pod, c: ContainerSpec) -> None:
        """manager.go Allocate: the devicesToReuse bookkeeping around one container."""
        with self._cond:
            self._reuse.setdefault(pod.uid, {})
            for other in [u for u in self._reuse if u != pod.uid]:
                del self._reuse[other]
            reuse = self._reuse[pod.uid]
        is_init = any(c.name == i.name for i in pod.init)
        self._allocate_container(pod, c, reuse)
        with self._cond:
            mine = self._pod_devices.get(pod.uid, {}).get(c.name, {})
            for res, a in mine.items():
                ids = {d for v in a.devices.values() for d in v}
                if is_init and not c.restartable:
                    reuse[res] = reuse.get(res, set()) | ids  # addContainerAllocatedResources
                else:
                    reuse[res] = reuse.get(res, set()) - ids  # removeContainerAllocatedResources

    def _allocate_container(self, pod: _Pod, c: ContainerSpec, reuse: dict[str, set[str]]) -> None:
        """manager.go allocateContainerResources for the pod's one device resource."""
        if c.devices <= 0 or not self._is_device_plugin_resource(pod.resource):
            return
        self._update_allocated_devices()
        res = pod.resource
        chosen, preferred = self._devices_to_allocate(pod, c, res, c.devices, reuse.get(res, set()))
        if not chosen:
            return
        with self._cond:
            ep = self._endpoints.get(res)
        if ep is None:
            raise AdmissionError(f"unknown Device Plugin {res}")
        resp = ep.allocate(chosen)
        by_numa: dict[int, list[str]] = {}
        with self._cond:
            for d in chosen:
                dev = self._all_devices.get(res, {}).get(d)
                for n in dev.numa if dev is not None and dev.numa else (NO_TOPOLOGY,):
                    by_numa.setdefault(n, []).append(d)
            self._pod_devices.setdefault(pod.uid, {}).setdefault(c.name, {})[res] = _Alloc(
                by_numa, resp.SerializeToString(deterministic=True)
            )
            self._preferred_now[(pod.uid, c.name)] = preferred
        self._write_checkpoint()

    def _is_device_plugin_resource(self, res: str) -> bool:
        # manager.go isDevicePluginResource: registered now, or held by a pod
        with self._cond:
            return res in self._healthy or res in self._endpoints or bool(self._allocated(res))

    def _devices_to_allocate(
        self, pod: _Pod, c: ContainerSpec, res: str, required: int, reusable: set[str]
    ) -> tuple[list[str], tuple[str, ...] | None]:
        """manager.go devicesToAllocate: (IDs to Allocate, GetPreferredAllocation's answer)."""
        with self._cond:
            needed = required
            have = self._container_devices(pod.uid, c.name, res)
            if have is not None:
                needed -= len(have)
                if needed != 0:
                    raise AdmissionError(
                        f'pod "{pod.uid}" container "{c.name}" changed request for resource "{res}" '
                        f"from {len(have)} to {required}"
                    )
            # kubelet restart (sources not ready) and the container reported running: it
            # already has its devices, nothing to do.
            if not self._sources_ready and c.name in pod.running:
                return [], None
            if res not in self._healthy:
                raise AdmissionError(f"cannot allocate unregistered device {res}")
            healthy = self._healthy[res]
            if not healthy:
                raise AdmissionError(f"no healthy devices present; cannot allocate unhealthy devices {res}")
            if have is not None and not have <= healthy:
                raise AdmissionError(
                    f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {res}"
                )
            if needed == 0:
                return [], None
            chosen: list[str] = []

            def take(ids: Iterable[str]) -> bool:
                nonlocal needed
                for d in ids:
                    if d in chosen:
                        continue
                    chosen.append(d)
                    needed -= 1
                    if needed == 0:
                        return True
                return False

            if take(sorted(reusable)):  # the init containers' devices first
                return chosen, None
            in_use = self._allocated(res) | set(chosen)
            available = sorted(healthy - in_use)
            if len(available) < needed:
                raise InsufficientDevices(
                    f"requested number of devices unavailable for {res}. Requested: {needed}, "
                    f"Available: {len(available)}"
                )
            ep = self._endpoints.get(res)
        # No topology hint (TopologyManager policy none): filterByAffinity puts every available
        # device in `noAffinity`, so the plugin is asked about all of them, with the reused ones
        # as must-include and the container's whole request as the size.
        preferred: tuple[str, ...] | None = None
        if ep is not None and ep.options.get_preferred_allocation_available:
            preferred = tuple(ep.preferred([*available, *chosen], required, must_include=list(chosen)))
            if take(d for d in preferred if d in available):
                return chosen, preferred
        if take(available):
            return chosen, preferred
        raise AdmissionError(
            f"unexpectedly allocated less resources than required. Requested: {required}, Got: {required - needed}"
        )

    def _start_containers(self, pod: _Pod, specs: Sequence[ContainerSpec]) -> dict[str, ContainerAllocation]:
        """Each container as kuberuntime starts it: manager.go GetDeviceRunContainerOptions."""
        out: dict[str, ContainerAllocation] = {}
        for c in specs:
            if c.devices <= 0 or not self._is_device_plugin_resource(pod.resource):
                continue
            res = pod.resource
            with self._cond:
                ep = self._endpoints.get(res)
                have = self._container_devices(pod.uid, c.name, res)
            # callPreStartContainerIfNeeded: only when the plugin asked; a resource restored from
            # the checkpoint whose plugin is not back has no options (stopped endpoint): skipped.
            if ep is not None and ep.options.pre_start_required:
                if have is None:
                    raise AdmissionError(
                        f"no devices found allocated in local cache for pod {pod.uid}, container {c.name}, "
                        f"resource {res}"
                    )
                ep.pre_start(sorted(have))
            if have is None and pod.active:
                # "likely due to a race during node restart. We re-issue allocate request"
                self._allocate(pod, c)
            with self._cond:
                a = self._pod_devices.get(pod.uid, {}).get(c.name, {}).get(res)
                preferred = self._preferred_now.pop((pod.uid, c.name), None)
            if a is None or a.resp is None:
                continue
            resp = dp.ContainerAllocateResponse.FromString(a.resp)
            out[c.name] = ContainerAllocation(
                namespace=pod.namespace,
                pod=pod.name,
                container=c.name,
                resource_name=res,
                device_ids=tuple(d for ids in a.devices.values() for d in ids),
                preferred=preferred,
                envs=dict(resp.envs),
                annotations=dict(resp.annotations),
                mounts=list(resp.mounts),
                devices=list(resp.devices),
                cdi_devices=[x.name for x in resp.cdi_devices],
            )
        return out

    # --- checkpoint -------------------------------------------------------------------
    def _write_checkpoint(self) -> None:
        # manager.go writeCheckpoint: every kept answer (pod_devices.go toCheckpointData skips
        # entries without one) and the healthy devices per resource.
        with self._cond:
            entries = [
                ckpt.Entry(uid, c, r, {k: list(v) for k, v in a.devices.items()}, a.resp)
                for uid, conts in self._pod_devices.items()
                for c, res in conts.items()
                for r, a in res.items()
                if a.resp is not None
            ]
            registered: dict[str, list[str] | None] = {r: sorted(ids) for r, ids in self._healthy.items()}
            blob = ckpt.marshal(entries or None, registered)
            self.checkpoint_writes += 1
        if not os.path.isdir(self.device_plugins_dir):
            return
        tmp = os.path.join(self.device_plugins_dir, f".{CHECKPOINT}.tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, self.checkpoint_path)

    def _read_checkpoint(self) -> None:
        # manager.go readCheckpoint: not found -> nothing; corrupt -> "Continue after failing to
        # read checkpoint file" (nothing restored).
        try:
            with open(self.checkpoint_path, "rb") as f:
                entries, registered = ckpt.unmarshal(f.read())
        except (FileNotFoundError, ValueError):
            return
        with self._cond:
            for e in entries or []:
                self._pod_devices.setdefault(e.pod_uid, {}).setdefault(e.container, {})[e.resource] = _Alloc(
                    {k: list(v or []) for k, v in (e.device_ids or {}).items()}, e.alloc_resp
                )
            for r in registered or {}:
                self._healthy[r] = set()
                self._unhealthy[r] = set()

    # --- PodResources v1 (apis/podresources/server_v1.go) -----------------------------------
    def _container_resources(self, pod: _Pod, c: ContainerSpec) -> pr.ContainerResources:
        cr = pr.ContainerResources(name=c.name)
        # container_manager.go containerDevicesFromResourceDeviceInstances: one entry per device
        # (and per NUMA node of it)
        for r, a in self._pod_devices.get(pod.uid, {}).get(c.name, {}).items():
            for numa, ids in a.devices.items():
                for d in ids:
                    if numa == NO_TOPOLOGY:
                        cr.devices.add(resource_name=r, device_ids=[d])
                    else:
                        cr.devices.add(
                            resource_name=r, device_ids=[d], topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=numa)])
                        )
        return cr

    def _pod_resources(self, pod: _Pod) -> pr.PodResources:
        p = pr.PodResources(name=pod.name, namespace=pod.namespace)
        # init containers only when restartable (sidecars), then the app containers
        for c in [*(i for i in pod.init if i.restartable), *pod.containers]:
            p.containers.append(self._container_resources(pod, c))
        return p

    def _list_pod_resources(self) -> pr.ListPodResourcesResponse:
        self._update_allocated_devices()
        resp = pr.ListPodResourcesResponse()
        with self._cond:
            for pod in self._pods.values():
                if pod.active:
                    resp.pod_resources.append(self._pod_resources(pod))
        return resp

    def _get_pod_resources(self, namespace: str, name: str) -> pr.PodResources | None:
        with self._cond:
            pod = self._find(namespace, name)
            return None if pod is None else self._pod_resources(pod)

    def _allocatable_resources(self) -> pr.AllocatableResourcesResponse:
        # manager.go GetAllocatableDevices: the healthy devices, one entry each
        resp = pr.AllocatableResourcesResponse()
        with self._cond:
            for r, ids in self._healthy.items():
                for d in sorted(ids):
                    dev = self._all_devices.get(r, {}).get(d)
                    if dev is not None and dev.numa:
                        for n in dev.numa:
                            resp.devices.add(
                                resource_name=r, device_ids=[d], topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n)])
                            )
                    else:
                        resp.devices.add(resource_name=r, device_ids=[d])
        return resp
