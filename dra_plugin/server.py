"""The two gRPC services of the DRA plugin, each on its own unix socket.

- `pluginregistration.Registration` on `<kubelet-dir>/plugins_registry/<driver>-reg.sock`: the
  kubelet's plugin watcher finds the socket, calls GetInfo (1 s timeout), validates the type and
  the services, registers the endpoint and calls NotifyRegistrationStatus
  (pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go GenerateRegisterPluginFunc).
- `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin` on `<kubelet-dir>/plugins/<driver>/dra.sock`, the
  endpoint GetInfo names, with `v1alpha1.DRAResourceHealth` on the same socket (the kubelet
  calls it on the endpoint: dra_plugin_manager.go; dra_plugin/health.py).

GetInfo advertises "v1.DRAPlugin": the service names the kubelet accepts are
`servicesSupportedByKubelet` = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
(pkg/kubelet/cm/dra/plugin/dra_plugin.go; the constants are kubelet/pkg/apis/dra/*/types.go
DRAPluginService); we serve only v1. As the kubelet plugin helper
(dynamic-resource-allocation kubeletplugin/draplugin.go Start), the service socket is served
before the registration socket appears, so the kubelet never finds an endpoint that does not
answer; on stop the registration socket goes first.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures

import grpc

from dra_plugin.api import dra_pb2 as dra
from dra_plugin.api import dra_pb2_grpc as dra_grpc
from dra_plugin.api import health_pb2_grpc as health_grpc
from dra_plugin.api import pluginregistration_pb2 as reg
from dra_plugin.api import pluginregistration_pb2_grpc as reg_grpc
from dra_plugin.driver import ClaimRef, Driver
from dra_plugin.health import HealthService
from nodecore.cli import socket_identity
from vgpu.log import kv

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"  # kubelet/pkg/apis/pluginregistration/v1/constants.go
DRA_SERVICE_V1 = "v1.DRAPlugin"  # kubelet/pkg/apis/dra/v1/types.go DRAPluginService


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, endpoint: str) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.last_status: reg.RegistrationStatus | None = None

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver_name, endpoint=self.endpoint, supported_versions=[DRA_SERVICE_V1]
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        self.last_status = request
        if not request.plugin_registered:
            self.registered.clear()
            log.error(kv("kubelet refused the registration", driver=self.driver_name, error=request.error[:500]))
            # As the helper's registrationServer: a refusal is answered with an error.
            context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error[:500]}")
        self.registered.set()
        log.warning(kv("registered with kubelet", driver=self.driver_name, endpoint=self.endpoint))
        return reg.RegistrationStatusResponse()


class DRAService(dra_grpc.DRAPluginServicer):
    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra.NodePrepareResourcesResponse:
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        results = self.driver.prepare(refs)
        out = dra.NodePrepareResourcesResponse()
        for uid, r in results.items():
            entry = out.claims[uid]
            if r.error:
                entry.error = r.error
                log.warning(kv("prepare refused", uid=uid[:64], error=r.error))
                continue
            for d in r.devices:
                dev = entry.devices.add(
                    request_names=d.request_names,
                    pool_name=d.pool,
                    device_name=d.device,
                    cdi_device_ids=d.cdi_device_ids,
                )
                if d.share_id is not None:
                    dev.share_id = d.share_id
        return out

    def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> dra.NodeUnprepareResourcesResponse:
        refs = [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]
        out = dra.NodeUnprepareResourcesResponse()
        for uid, err in self.driver.unprepare(refs).items():
            entry = out.claims[uid]  # every claim gets an entry, even an empty one
            if err:
                entry.error = err
        return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Socket:
    """One gRPC server on one unix socket."""

    def __init__(self, path: str, workers: int) -> None:
        self.path = path
        self.workers = workers
        self.server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None

    def start(self, add: object) -> None:
        _unlink(self.path)  # a stale socket of an earlier run would make bind fail
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dra-grpc"),
            options=[("grpc.so_reuseport", 0)],
        )
        add(server)  # type: ignore[operator]
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise OSError(f"cannot bind {self.path}")
        server.start()
        self.server = server
        self.identity = socket_identity(self.path)

    def ours(self) -> bool:
        return self.identity is not None and socket_identity(self.path) == self.identity

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=0).wait(2.0)
            self.server = None
        # Only the socket we made: another instance may own the path by now.
        if self.ours():
            _unlink(self.path)
        self.identity = None


class PluginServer:
    """Both sockets of one serving instance; started and stopped as a whole."""

    # The kubelet keeps one health stream open (and may open another while the old one ends):
    # threads of their own beside the workers for prepare and unprepare.
    HEALTH_STREAMS = 2

    def __init__(self, driver: Driver, registration_socket: str, endpoint: str, workers: int = 8) -> None:
        self.driver = driver
        self.registration = RegistrationService(driver.cfg.driver_name, endpoint)
        self.service = DRAService(driver)
        core = driver.node_core
        self.health = HealthService(driver.node, core.gpus, core.health_of)
        self.dra_socket = _Socket(endpoint, workers + self.HEALTH_STREAMS)
        self.reg_socket = _Socket(registration_socket, 2)

    def start(self) -> None:
        os.makedirs(os.path.dirname(self.dra_socket.path), mode=0o750, exist_ok=True)
        os.makedirs(os.path.dirname(self.reg_socket.path), mode=0o750, exist_ok=True)
        self.dra_socket.start(self._add_services)
        self.wait_ready()
        self.reg_socket.start(lambda s: reg_grpc.add_RegistrationServicer_to_server(self.registration, s))

    def _add_services(self, server: grpc.Server) -> None:
        dra_grpc.add_DRAPluginServicer_to_server(self.service, server)
        health_grpc.add_DRAResourceHealthServicer_to_server(self.health, server)

    def wait_ready(self, timeout: float = 5.0) -> None:
        """One real RPC on our own service socket (an empty prepare) before registering."""
        with grpc.insecure_channel(f"unix://{self.dra_socket.path}") as ch:
            dra_grpc.DRAPluginStub(ch).NodePrepareResources(
                dra.NodePrepareResourcesRequest(), timeout=timeout, wait_for_ready=True
            )

    def alive(self) -> bool:
        """Both sockets are still the ones we made."""
        return self.dra_socket.ours() and self.reg_socket.ours()

    def stop(self) -> None:
        self.reg_socket.stop()
        self.health.close()  # ends the streams, or stop() would wait on their threads
        self.dra_socket.stop()
