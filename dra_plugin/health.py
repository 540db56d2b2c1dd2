"""`v1alpha1.DRAResourceHealth` on the DRA service socket: the GPUs' health, as the node core's
health monitor sees it (XID events, lost GPUs, recovery), streamed to the kubelet.

The kubelet (v1.36, ResourceHealthStatus) opens NodeWatchResources on every registered DRA plugin
and, when the call fails or the stream ends, tries again every 5 s
(pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, wait.UntilWithContext). Each response is the
driver's complete list; a device missing from it, or not reported again within its
health_check_timeout_seconds (0: the kubelet's 30 s, pkg/kubelet/cm/dra/healthinfo.go
DefaultHealthTimeout), becomes Unknown (manager.go HandleWatchResourcesStream, healthinfo.go
updateHealthInfo). The kubelet puts a changed device's health into the status of the pods whose
claims use it (`allocatedResourcesStatus`). So: the full list at once, again on every change, and
again every `interval_s`, well inside the timeout we declare.

A stream holds one server thread for as long as the kubelet keeps it: the socket's pool is sized
for it (server.PluginServer), and a stream ends when the server stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from dra_plugin.api import health_pb2 as hp
from dra_plugin.api import health_pb2_grpc as hg
from dra_plugin.slices import device_name
from vgpu.nvml import GPUInfo

INTERVAL_S = 10.0
TIMEOUT_S = 30  # declared per device: three intervals
MESSAGE_MAX = 1024  # the kubelet truncates longer messages


class HealthService(hg.DRAResourceHealthServicer):
    def __init__(
        self,
        pool: str,
        gpus: Sequence[GPUInfo],
        health: Callable[[str], tuple[bool, str]],
        *,
        interval_s: float = INTERVAL_S,
    ) -> None:
        """health(uuid) -> (healthy, reason)."""
        self.pool = pool
        self.gpus = list(gpus)
        self.health = health
        self.interval_s = interval_s
        self._cv = threading.Condition()
        self._generation = 0
        self._closed = False

    def changed(self) -> None:
        """A GPU's health changed (the node core's callback): every stream sends the list now."""
        with self._cv:
            self._generation += 1
            self._cv.notify_all()

    def close(self) -> None:
        """End every stream (the server is stopping)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def snapshot(self) -> hp.NodeWatchResourcesResponse:
        now = int(time.time())
        out = hp.NodeWatchResourcesResponse()
        for g in self.gpus:
            ok, reason = self.health(g.uuid)
            out.devices.add(
                device=hp.DeviceIdentifier(pool_name=self.pool, device_name=device_name(g)),
                health=hp.HEALTHY if ok else hp.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=TIMEOUT_S,
                message="" if ok else reason[:MESSAGE_MAX],
            )
        return out

    def NodeWatchResources(
        self, request: hp.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[hp.NodeWatchResourcesResponse]:
        done = threading.Event()

        def gone() -> None:  # the kubelet cancelled or went away
            done.set()
            with self._cv:
                self._cv.notify_all()

        context.add_callback(gone)
        while True:
            with self._cv:
                seen = self._generation
            yield self.snapshot()
            deadline = time.monotonic() + self.interval_s
            with self._cv:
                while self._generation == seen and not self._closed and not done.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
                if self._closed or done.is_set():
                    return
