"""A kubelet stand-in for DRA plugin tests: the plugin watcher's registration and the DRA
manager's calls, over real gRPC on real unix sockets. NOT the kubelet.

Modelled on kubelet v1.36 (openshift/kubernetes as vendored for 1.36.2):

- `pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go` handleCreateEvent: a new unix
  socket in `<root>/plugins_registry` (names starting with "." ignored, other files ignored)
  is registered; this stand-in polls the directory (the kubelet uses fsnotify).
- `pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`
  GenerateRegisterPluginFunc: dial, GetInfo with a 1 s timeout, a handler for the type
  ("DRAPlugin" only here) else NotifyRegistrationStatus(false, "no handler registered..."),
  an empty endpoint defaults to the registration socket, ValidatePlugin, RegisterPlugin, then
  NotifyRegistrationStatus(true) (5 s timeout, notifyTimeoutDuration).
- `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go` validateSupportedServices (the first of the
  plugin's services that the kubelet supports, from `servicesSupportedByKubelet` =
  ["v1.DRAPlugin", "v1beta1.DRAPlugin"] in dra_plugin.go; none: an error) and `add` (an endpoint
  already registered for the driver is refused).
- `pkg/kubelet/cm/dra/manager.go` prepareResources / unprepareResources: one call per plugin
  with the claims, then: a result for a claim not asked about is an error, a claim's `error`
  fails it, a missing claim is "skipped"; `claiminfo.go` cdiDevicesAsList gives a container the
  CDI IDs of the devices of the requests it uses (a device without request names: all).
- `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go` add: with ResourceHealthStatus (on in the
  recorded v1.36.2 cluster, tests/data/dra) the kubelet opens the plugin's
  `/v1alpha1.DRAResourceHealth/NodeWatchResources` stream whether or not the plugin advertised
  it, and retries every 5 s; the stand-in makes one attempt and keeps its status code.
- `pkg/kubelet/pluginmanager/reconciler/reconciler.go` reconcile: a socket whose registration
  failed (a GetInfo timeout under load, a refusal) is registered again, with the exponential
  backoff of pkg/util/goroutinemap/exponentialbackoff (500 ms, doubling, at most 2 m 2 s).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from dra_plugin.api import dra_pb2 as dra
from dra_plugin.api import dra_pb2_grpc as dra_grpc
from dra_plugin.api import pluginregistration_pb2 as reg
from dra_plugin.api import pluginregistration_pb2_grpc as reg_grpc

DRA_PLUGIN_TYPE = "DRAPlugin"
SERVICES_SUPPORTED_BY_KUBELET = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
GET_INFO_TIMEOUT_S = 1.0
NOTIFY_TIMEOUT_S = 5.0
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 122.0


class KubeletError(RuntimeError):
    """What the kubelet would report for the pod (FailedPrepareDynamicResources)."""


@dataclass
class Registration:
    socket: str
    ok: bool
    driver: str = ""
    endpoint: str = ""
    versions: list[str] = field(default_factory=list)
    service: str = ""
    error: str = ""
    at: float = 0.0
    health: str = ""  # status code of the NodeWatchResources attempt


@dataclass
class PreparedDevice:
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None


@dataclass
class Claim:
    namespace: str
    name: str
    uid: str

    def pb(self) -> dra.Claim:
        return dra.Claim(namespace=self.namespace, name=self.name, uid=self.uid)


def cdi_devices(devices: list[PreparedDevice], request: str = "") -> list[str]:
    """claiminfo.go cdiDevicesAsList for one request of a claim."""
    out: list[str] = []
    for d in devices:
        if not request or not d.request_names or request in d.request_names:
            out.extend(d.cdi_device_ids)
    return out


class DRAKubelet:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.registry_dir = self.root / "plugins_registry"
        self.registrations: list[Registration] = []
        self.plugins: dict[str, tuple[str, str]] = {}  # driver -> (endpoint, chosen service)
        self._seen: dict[str, tuple[int, int]] = {}
        self._reg_socket: dict[str, str] = {}  # driver -> registration socket
        self._retry: dict[str, tuple[float, float]] = {}  # socket -> (when, backoff) after a failure
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- plugin watcher ---------------------------------------------------------------------------
    def start(self) -> DRAKubelet:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        (self.root / "plugins").mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="drakubelet-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> DRAKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            try:
                names = os.listdir(self.registry_dir)
            except FileNotFoundError:
                continue
            live = set()
            for name in names:
                if name.startswith("."):
                    continue
                path = str(self.registry_dir / name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if not stat.S_ISSOCK(st.st_mode):
                    continue
                live.add(path)
                ident = (st.st_ino, st.st_ctime_ns)
                if self._seen.get(path) != ident:
                    if path in self._seen:  # replaced between two looks: removed, then created
                        self._deregister(path)
                    self._seen[path] = ident
                    self._retry.pop(path, None)
                    self._attempt(path, RETRY_INITIAL_S)
                elif path in self._retry and time.monotonic() >= self._retry[path][0]:
                    self._attempt(path, min(self._retry[path][1] * 2, RETRY_MAX_S))
            for path in [p for p in self._seen if p not in live]:
                del self._seen[path]
                self._retry.pop(path, None)
                self._deregister(path)

    def _attempt(self, path: str, backoff: float) -> None:
        if self._register(path):
            self._retry.pop(path, None)
        else:
            self._retry[path] = (time.monotonic() + backoff, backoff)

    def _deregister(self, socket: str) -> None:
        """DeRegisterPlugin: the registration socket is gone."""
        with self._cond:
            for drv in [d for d, s in self._reg_socket.items() if s == socket]:
                self.plugins.pop(drv, None)
                del self._reg_socket[drv]
            self._cond.notify_all()

    def _register(self, socket: str) -> bool:
        r = Registration(socket=socket, ok=False, at=time.monotonic())
        try:
            with grpc.insecure_channel(f"unix://{socket}") as ch:
                stub = reg_grpc.RegistrationStub(ch)
                info = stub.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT_S, wait_for_ready=True)
                r.driver, r.endpoint, r.versions = info.name, info.endpoint or socket, list(info.supported_versions)
                if info.type != DRA_PLUGIN_TYPE:
                    r.error = (
                        f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket {socket}"
                    )
                else:
                    chosen = next((s for s in info.supported_versions if s in SERVICES_SUPPORTED_BY_KUBELET), "")
                    if not info.supported_versions:
                        r.error = "empty list of supported gRPC services (aka supported versions)"
                    elif not chosen:
                        r.error = (
                            f"none of services supported by the plugin ({list(info.supported_versions)}) "
                            f"are supported by the kubelet ({SERVICES_SUPPORTED_BY_KUBELET})"
                        )
                    elif self.plugins.get(info.name, ("", ""))[0] == r.endpoint:
                        r.error = f"endpoint {r.endpoint} already registered for DRA driver plugin {info.name}"
                    else:
                        r.service = chosen
                with self._cond:
                    if not r.error:
                        self.plugins[info.name] = (r.endpoint, r.service)
                        self._reg_socket[info.name] = socket
                try:
                    stub.NotifyRegistrationStatus(
                        reg.RegistrationStatus(plugin_registered=not r.error, error=r.error), timeout=NOTIFY_TIMEOUT_S
                    )
                except grpc.RpcError as e:
                    if not r.error:  # the kubelet deregisters a plugin it cannot notify
                        r.error = f"failed to send registration status: {e.details() if hasattr(e, 'details') else e}"
                        with self._cond:
                            self.plugins.pop(info.name, None)
                r.ok = not r.error
                if r.ok:
                    r.health = self._watch_health(r.endpoint)
        except grpc.RpcError as e:
            r.error = (
                f"RegisterPlugin error -- failed to get plugin info: {e.details() if hasattr(e, 'details') else e}"
            )
        with self._cond:
            self.registrations.append(r)
            self._cond.notify_all()
        return r.ok

    @staticmethod
    def _watch_health(endpoint: str) -> str:
        with grpc.insecure_channel(f"unix://{endpoint}") as ch:
            stream = ch.unary_stream(
                "/v1alpha1.DRAResourceHealth/NodeWatchResources",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )(b"", timeout=2.0)
            try:
                for _ in stream:
                    return "OK"
                return "OK"
            except grpc.RpcError as e:
                return e.code().name if hasattr(e, "code") else "ERROR"

    def wait_registered(self, driver: str, count: int = 1, timeout: float = 10.0) -> Registration:
        """The `count`-th successful registration of `driver`."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: len([r for r in self.registrations if r.ok and r.driver == driver]) >= count, timeout
            )
            if not ok:
                raise TimeoutError(f"{driver} not registered {count}x within {timeout}s: {self.registrations}")
            return [r for r in self.registrations if r.ok and r.driver == driver][count - 1]

    def wait_registration(self, count: int = 1, timeout: float = 10.0) -> Registration:
        """The `count`-th registration attempt, successful or not."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.registrations) >= count, timeout):
                raise TimeoutError(f"no registration attempt #{count} within {timeout}s")
            return self.registrations[count - 1]

    # --- DRA manager ----------------------------------------------------------------------------
    def _stub(self, driver: str) -> tuple[grpc.Channel, dra_grpc.DRAPluginStub]:
        with self._cond:
            ep = self.plugins.get(driver)
        if ep is None:
            raise KubeletError(f"DRA driver {driver} is not registered with the kubelet")
        ch = grpc.insecure_channel(f"unix://{ep[0]}")
        return ch, dra_grpc.DRAPluginStub(ch)

    def prepare_raw(self, driver: str, claims: list[Claim], timeout: float = 45.0) -> dra.NodePrepareResourcesResponse:
        ch, stub = self._stub(driver)
        with ch:
            return stub.NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[c.pb() for c in claims]), timeout=timeout
            )

    def prepare(self, driver: str, claims: list[Claim], timeout: float = 45.0) -> dict[str, list[PreparedDevice]]:
        """As manager.go prepareResources: every claim prepared, or KubeletError."""
        resp = self.prepare_raw(driver, claims, timeout)
        asked = {c.uid: c for c in claims}
        out: dict[str, list[PreparedDevice]] = {}
        for uid, result in resp.claims.items():
            if uid not in asked:
                raise KubeletError(f"NodePrepareResources returned result for unknown claim UID {uid}")
            if result.error:
                raise KubeletError(f"NodePrepareResources failed for ResourceClaim {asked[uid].name}: {result.error}")
            out[uid] = [
                PreparedDevice(
                    list(d.request_names),
                    d.pool_name,
                    d.device_name,
                    list(d.cdi_device_ids),
                    d.share_id if d.HasField("share_id") else None,
                )
                for d in result.devices
            ]
        missing = len(asked) - len(out)
        if missing:
            raise KubeletError(f"NodePrepareResources skipped {missing} ResourceClaims")
        return out

    def unprepare_raw(
        self, driver: str, claims: list[Claim], timeout: float = 45.0
    ) -> dra.NodeUnprepareResourcesResponse:
        ch, stub = self._stub(driver)
        with ch:
            return stub.NodeUnprepareResources(
                dra.NodeUnprepareResourcesRequest(claims=[c.pb() for c in claims]), timeout=timeout
            )

    def unprepare(self, driver: str, claims: list[Claim], timeout: float = 45.0) -> None:
        resp = self.unprepare_raw(driver, claims, timeout)
        asked = {c.uid: c for c in claims}
        for uid, result in resp.claims.items():
            if uid not in asked:
                raise KubeletError(f"NodeUnprepareResources returned result for unknown claim UID {uid}")
            if result.error:
                raise KubeletError(f"NodeUnprepareResources failed for ResourceClaim {asked[uid].name}: {result.error}")
        missing = len(asked) - len(resp.claims)
        if missing:
            raise KubeletError(f"NodeUnprepareResources skipped {missing} ResourceClaims")
