"""`v1alpha1.DRAResourceHealth/NodeWatchResources` as the kubelet v1.36 calls it on the DRA
endpoint (a client generated from our .proto, over the unix socket): the complete device list at
once, again on every health change and every interval, each device with its pool, name, status,
reason and timeout; the stream ends when the plugin stops (the kubelet then retries every 5 s,
dra_plugin_manager.go)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest

from dra_plugin.api import health_pb2 as hp
from dra_plugin.api import health_pb2_grpc as hg
from dra_plugin.config import Settings
from sim import kubeapi
from sim.drakubelet import DRAKubelet
from tests.dra_plugin.conftest import NODE, gpus
from tests.dra_plugin.support import Plugin, start_plugin

pytestmark = pytest.mark.timeout(60)
GPUS = gpus(2)


@pytest.fixture
def plugin(cfg: Settings, kube: kubeapi.KubeAPI) -> Iterator[Plugin]:
    with DRAKubelet(cfg.kubelet_dir) as kubelet:
        p = start_plugin(cfg, GPUS, kube)
        kubelet.wait_registered("gpu.vgpu.k8s.io")
        try:
            yield p
        finally:
            p.stop()


def devices(resp: hp.NodeWatchResourcesResponse) -> dict[str, tuple[str, int, str, int]]:
    return {
        d.device.device_name: (d.device.pool_name, d.health, d.message, d.health_check_timeout_seconds)
        for d in resp.devices
    }


def test_health_stream_follows_the_node_core(cfg: Settings, plugin: Plugin) -> None:
    plugin.server.health.interval_s = 600.0  # only changes send a new list here
    with grpc.insecure_channel(f"unix://{cfg.endpoint}") as ch:
        stream = hg.DRAResourceHealthStub(ch).NodeWatchResources(hp.NodeWatchResourcesRequest(), timeout=50)
        first = next(stream)
        assert devices(first) == {"gpu-0": (NODE, hp.HEALTHY, "", 30), "gpu-1": (NODE, hp.HEALTHY, "", 30)}
        assert all(abs(d.last_updated_time - time.time()) < 60 for d in first.devices)
        table = plugin.driver.node_core.table
        assert table.mark_unhealthy(GPUS[1].uuid, "XID 79 (fallen off the bus)")
        plugin.server.health.changed()  # what the node core's health monitor calls
        assert devices(next(stream))["gpu-1"] == (NODE, hp.UNHEALTHY, "XID 79 (fallen off the bus)", 30)
        assert table.mark_healthy(GPUS[1].uuid)
        plugin.server.health.changed()
        assert devices(next(stream))["gpu-1"] == (NODE, hp.HEALTHY, "", 30)
        # the plugin stops: the stream ends (the kubelet will open a new one on the next plugin)
        plugin.server.stop()
        with pytest.raises((StopIteration, grpc.RpcError)):
            while True:
                next(stream)


def test_health_is_sent_again_before_the_kubelet_times_it_out(cfg: Settings, plugin: Plugin) -> None:
    plugin.server.health.interval_s = 0.2
    with grpc.insecure_channel(f"unix://{cfg.endpoint}") as ch:
        stream = hg.DRAResourceHealthStub(ch).NodeWatchResources(hp.NodeWatchResourcesRequest(), timeout=50)
        got = [next(stream) for _ in range(3)]  # no change at all: the same complete list again
        assert all(len(r.devices) == 2 for r in got)
        stream.cancel()
    # a cancelled stream frees its thread: prepare still answers, and a new stream works
    with grpc.insecure_channel(f"unix://{cfg.endpoint}") as ch:
        stream = hg.DRAResourceHealthStub(ch).NodeWatchResources(hp.NodeWatchResourcesRequest(), timeout=50)
        assert len(next(stream).devices) == 2
        stream.cancel()
