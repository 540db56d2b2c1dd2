"""Helpers of the DRA plugin tests: a plugin instance in this process (driver + both gRPC
sockets) and claims allocated the way kube-scheduler would (sim/draallocator.py),
stored in the API server stand-in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dra_plugin import apiclient, slices
from dra_plugin.config import Settings
from dra_plugin.driver import Driver
from dra_plugin.server import PluginServer
from nodecore.core import NodeCore
from sim import draallocator, kubeapi
from sim.drakubelet import Claim
from tests.dra_plugin.conftest import NODE
from vgpu.nvml import GPUInfo


@dataclass
class Plugin:
    driver: Driver
    server: PluginServer

    def stop(self) -> None:
        self.server.stop()
        self.driver.close()


def node_core(cfg: Settings, gpus: list[GPUInfo]) -> NodeCore:
    """The node core over these GPUs, without NVML health threads."""
    return NodeCore(gpus, cfg.slicing, cfg.paths, health_recovery_s=cfg.health_recovery_s, nvml_health=False)


def start_plugin(cfg: Settings, gpus: list[GPUInfo], api: kubeapi.KubeAPI | None) -> Plugin:
    resource_api = apiclient.KubeResourceAPI(api.api_client()) if api is not None else None
    driver = Driver(cfg, NODE, node_core(cfg, gpus), resource_api)
    driver.recover()
    server = PluginServer(driver, cfg.registration_socket, cfg.endpoint)
    server.start()
    return Plugin(driver, server)


class Claims:
    """Claims allocated from the node's published slices and stored in the API stand-in."""

    def __init__(self, api: kubeapi.KubeAPI, cfg: Settings, gpus: list[GPUInfo]) -> None:
        self.api = api
        self.alloc = draallocator.Allocator(slices.build(NODE, gpus, cfg, generation=1))
        self.n = 0

    def make(
        self,
        requests: dict[str, dict[str, str]] | None = None,
        namespace: str = "default",
        name: str | None = None,
        pods: tuple[str, ...] = ("pod-a",),
    ) -> Claim:
        """One claim with a result per request name (capacity requests as given)."""
        self.n += 1
        results = [self.alloc.allocate(req, caps) for req, caps in (requests or {"gpu": {}}).items()]
        return self.store(draallocator.claim_object(name or f"claim-{self.n}", namespace, results, pods=pods))

    def store(self, obj: dict[str, Any]) -> Claim:
        meta = obj["metadata"]
        got = self.api.create("resourceclaims", obj, meta["namespace"], api_version="resource.k8s.io/v1")
        return Claim(meta["namespace"], meta["name"], got["metadata"]["uid"])

    def get(self, c: Claim) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(json.dumps(self.api.get("resourceclaims", c.name, c.namespace)))
        return obj
