"""The DevicePlugin gRPC service (v1beta1) served on a unix socket."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc

from device_plugin import allocator, decision
from device_plugin import strategy as device_strategy
from device_plugin.api import deviceplugin_pb2 as pb
from device_plugin.api import deviceplugin_pb2_grpc as pb_grpc
from device_plugin.decisionpolicy import Claim, DecisionError
from nodecore import records
from nodecore.cli import socket_identity
from nodecore.devices import DeviceTable
from vgpu import contextsizes
from vgpu.log import kv
from vgpu.paths import Paths
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV

log = logging.getLogger(__name__)

# How often an idle ListAndWatch stream checks that its client is still there
# (a server stop wakes streams at once through DeviceTable.kick()).
_STREAM_POLL_S = 1.0


def device_list(table: DeviceTable) -> tuple[int, pb.ListAndWatchResponse]:
    version, devs = table.snapshot()
    resp = pb.ListAndWatchResponse()
    for vid, health, numa in devs:
        d = resp.devices.add(ID=vid, health=health)
        if numa is not None:
            d.topology.nodes.add(ID=numa)
    return version, resp


class DevicePluginService(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        table: DeviceTable,
        paths: Paths,
        resource_name: str,
        policy: str,
        stop: threading.Event,
        decisions: decision.Decisions | None = None,
        strategy: device_strategy.Strategy | None = None,
        on_allocated: Callable[[str, str, str], None] | None = None,
        prepare: Callable[[Claim | None, allocator.Slice], allocator.Slice] | None = None,
    ) -> None:
        # Makes what the slice needs before its record is written (dynamic MIG: the decided
        # instance, device_plugin/dynmig.py) and returns the slice the container gets; raises
        # DecisionError when it cannot.
        self.prepare = prepare
        # Told of every record written: (token, pod UID, container) of the decision it honoured,
        # ("" when none): the node's published usage (device_plugin/usage.py).
        self.on_allocated = on_allocated
        self.strategy = strategy or device_strategy.Strategy()
        self.decisions = decisions  # scheduler decisions (None: every container gets n x 1/K)
        self.table = table
        self.paths = paths
        self.resource_name = resource_name
        self.policy = policy
        self.stop = stop

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        version, resp = device_list(self.table)
        yield resp
        while not self.stop.is_set() and context.is_active():
            new = self.table.wait_change(version, _STREAM_POLL_S, self.stop)
            if new != version and not self.stop.is_set():
                version, resp = device_list(self.table)
                yield resp

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        out = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            steered = (
                self.decisions.preferred(
                    list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), int(creq.allocation_size)
                )
                if self.decisions is not None
                else None
            )
            ids = steered or allocator.preferred(
                self.table,
                list(creq.available_deviceIDs),
                list(creq.must_include_deviceIDs),
                int(creq.allocation_size),
                self.policy,
            )
            out.container_responses.add(deviceIDs=ids)
        return out

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        out = pb.AllocateResponse()
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            claim = None
            try:
                sl = allocator.slice_for(self.table, ids)
                claim = self.decisions.claim(ids) if self.decisions is not None else None
                if claim is not None:
                    sl = claim.slice  # the decided GPUs, bytes and percent instead of n x 1/K
                if self.prepare is not None:
                    sl = self.prepare(claim, sl)
            except allocator.AllocationError as e:
                log.warning(kv("allocate refused", devices=",".join(d[:80] for d in ids[:16]), reason=e))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except DecisionError as e:
                if claim is not None and self.decisions is not None:
                    self.decisions.release(claim)  # not served: the kubelet's retry asks again
                log.warning(kv("allocate refused", devices=",".join(d[:80] for d in ids[:16]), reason=e))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except decision.ApiUnavailable as e:
                log.error(kv("allocate refused", reason=e))
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            try:
                rec = records.RecordStore(self.paths, self.resource_name).write(
                    sl.gpus, self.table.slicing.oversubscribe
                )
            except OSError as e:
                log.error("cannot write allocation record: %s", e)
                if claim is not None and self.decisions is not None:
                    self.decisions.release(claim)
                context.abort(grpc.StatusCode.INTERNAL, f"cannot write allocation record: {e.strerror}")
            if self.on_allocated is not None:
                tag = (claim.pod.uid, claim.container.name) if claim is not None else ("", "")
                self.on_allocated(rec.token, *tag)
            if claim is not None and self.decisions is not None:
                self.decisions.confirm(claim)
            cresp = out.container_responses.add()
            device_strategy.fill(cresp, sl.uuids, self.strategy)
            cresp.envs[TOKEN_ENV] = rec.token
            # libvgpu.so charges each process this much for its CUDA context until the monitor
            # has measured that process: the context size the monitor measured on these GPUs.
            # Security: the env is the container's, which may override it; harmless, since the
            # library takes max(compiled default, env) (state.c), so the env can only make its
            # limit stricter, and a pod that lowers it only risks its own processes (the
            # monitor's backstop still holds what NVML sees to the limit, for the neighbours).
            reserve = contextsizes.reserve_for(self.paths.context_sizes_path, sl.uuids)
            if reserve:
                cresp.envs[contextsizes.RESERVE_ENV] = str(reserve)
            cresp.annotations[TOKEN_ANNOTATION] = rec.token
            if log.isEnabledFor(logging.INFO):  # the line is built only when it is wanted
                log.info(
                    kv(
                        "allocated",
                        devices=",".join(ids),
                        gpus=";".join(f"{g.uuid}:{g.memory_limit}B:{g.core_percent}%" for g in sl.gpus),
                        oversubscribe=int(rec.oversubscribe),
                        # The token selects a record, i.e. limits: only a prefix goes to logs.
                        token=rec.token[:8] + "…",
                    )
                )
        return out

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class PluginServer:
    """One serving instance of the plugin on its socket; restarted as a whole."""

    def __init__(self, service_args: dict, socket_path: str, workers: int = 16) -> None:
        self.socket_path = socket_path
        self.stop_event = threading.Event()
        self.service = DevicePluginService(stop=self.stop_event, **service_args)
        self.server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None  # (inode, ctime_ns) of our socket
        self.started_at = 0.0
        self._workers = workers

    def start(self) -> None:
        # A stale socket (previous run, crash) would make bind fail.
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="grpc"),
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_DevicePluginServicer_to_server(self.service, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot bind {self.socket_path}")
        server.start()
        self.server = server
        self.identity = socket_identity(self.socket_path)
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float = 5.0) -> None:
        """Dial our own socket, as NVIDIA's plugin does before registering."""
        # One real RPC: proves the socket accepts and the service answers.
        # (channel_ready_future polls connectivity and costs ~200 ms.)
        with grpc.insecure_channel(f"unix://{self.socket_path}") as ch:
            pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=timeout, wait_for_ready=True)

    def alive(self, timeout: float = 2.0) -> bool:
        """The socket is still ours and the server answers."""
        if socket_identity(self.socket_path) != self.identity:
            return False
        try:
            with grpc.insecure_channel(f"unix://{self.socket_path}") as ch:
                pb_grpc.DevicePluginStub(ch).GetDevicePluginOptions(pb.Empty(), timeout=timeout)
        except grpc.RpcError:
            return False
        return True

    def stop(self) -> None:
        self.stop_event.set()
        self.service.table.kick()  # end ListAndWatch streams now
        if self.server is not None:
            self.server.stop(grace=0).wait(2.0)
            self.server = None
        # Remove the socket only if it is still the one we created: kubelet may
        # already have deleted it, and a new instance may own the path now.
        try:
            if self.identity is not None and socket_identity(self.socket_path) == self.identity:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
