"""Node inventory annotation (contract: vgpu/scheduling.py `NodeInventory`, version 2).

`inventory()` builds the document (pure, given the time); `NodeAnnotator` patches the Node
through the kubernetes client when an API server is reachable (in-cluster service account or
kubeconfig), and otherwise says so once and does nothing. The document carries a `heartbeat`
(unix seconds): the annotator re-patches it every `heartbeat_s` even when nothing else changed,
so the scheduler can tell a live plugin from a dead one (it stops offering a node whose
heartbeat is older than its `stale_after_s`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from typing import Any

from device_plugin.devices import DeviceTable
from vgpu import scheduling
from vgpu.scheduling import InventoryGPU, NodeInventory

log = logging.getLogger(__name__)

ANNOTATION = scheduling.INVENTORY_ANNOTATION
INVENTORY_VERSION = scheduling.INVENTORY_VERSION


def inventory(table: DeviceTable, resource_name: str, now: float) -> NodeInventory:
    s = table.slicing
    gpus = []
    for st in table.gpus.values():
        g = st.info
        gpus.append(
            InventoryGPU(
                uuid=g.uuid,
                index=g.index,
                model=g.name,
                memory=g.memory_total,
                memory_schedulable=math.floor(g.memory_total * s.memory_scaling),
                cores=math.floor(100 * s.cores_scaling + 1e-9),
                split_count=len(st.ids),
                numa=-1 if g.numa_node is None else g.numa_node,
                health=table.is_healthy(g.uuid),
            )
        )
    return NodeInventory(
        version=INVENTORY_VERSION,
        resource=resource_name,
        split_count=s.split_count,
        memory_scaling=s.memory_scaling,
        cores_scaling=s.cores_scaling,
        heartbeat=now,
        gpus=gpus,
    )


def build(table: DeviceTable, resource_name: str, now: float | None = None) -> str:
    """The annotation's JSON text."""
    return scheduling.encode(inventory(table, resource_name, time.time() if now is None else now))


def node_name(configured: str) -> str:
    return configured or os.environ.get("NODE_NAME") or socket.gethostname()


def load_client() -> Any | None:
    """A CoreV1Api, or None when no API server configuration exists."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    files = [p for p in kubeconfig.split(os.pathsep) if p and os.path.isfile(p)]
    if not in_cluster and not files:
        log.info("no in-cluster environment and no kubeconfig at %s", kubeconfig)
        return None
    from kubernetes import client, config  # slow import: only when needed

    try:
        if in_cluster:
            config.load_incluster_config()
        else:
            # Explicit file: the client reads $KUBECONFIG once, at import time.
            config.load_kube_config(config_file=files[0])
    except Exception as e:  # ConfigException, missing files, bad kubeconfig
        log.info("kubernetes client configuration: %s", e)
        return None
    return client.CoreV1Api()


class NodeAnnotator:
    """Publishes the inventory annotation; thread-safe, never raises.

    The Node is patched when the inventory (all but the heartbeat) changed, or when the last
    successful patch is `heartbeat_s` old.
    """

    def __init__(
        self,
        table: DeviceTable,
        resource_name: str,
        node: str,
        heartbeat_s: float = scheduling.DEFAULT_HEARTBEAT_S,
    ) -> None:
        self.table = table
        self.resource_name = resource_name
        self.node = node
        self.heartbeat_s = heartbeat_s
        self._api: Any | None = None
        self._disabled = False
        self._lock = threading.Lock()
        self._last: NodeInventory | None = None  # last document the Node holds (heartbeat included)
        self._warned = False

    def publish(self, now: float | None = None) -> bool:
        """Patch the Node if the inventory changed or its heartbeat is due; True when the Node holds it."""
        with self._lock:
            if self._disabled:
                return False
            if self._api is None:
                try:
                    self._api = load_client()
                except Exception as e:
                    log.warning("kubernetes client unavailable: %s", e)
                    self._api = None
                if self._api is None:
                    self._disabled = True
                    log.warning("no Kubernetes API server configured; node inventory annotation disabled")
                    return False
            now = time.time() if now is None else now
            inv = inventory(self.table, self.resource_name, now)
            last = self._last
            if last is not None and _same(last, inv) and now - last.heartbeat < self.heartbeat_s:
                return True
            body = {"metadata": {"annotations": {ANNOTATION: scheduling.encode(inv)}}}
            try:
                self._api.patch_node(self.node, body, _request_timeout=10)
            except Exception as e:  # ApiException, connection errors
                if not self._warned:
                    log.warning("cannot annotate node %s: %s", self.node, str(e).splitlines()[0] if str(e) else e)
                    self._warned = True
                return False
            changed = last is None or not _same(last, inv)
            self._last = inv
            self._warned = False
            (log.info if changed else log.debug)("node %s annotated with the GPU inventory", self.node)
            return True


def _same(a: NodeInventory, b: NodeInventory) -> bool:
    """Equal but for the heartbeat."""
    return a.gpus == b.gpus and (a.resource, a.split_count, a.memory_scaling, a.cores_scaling) == (
        b.resource,
        b.split_count,
        b.memory_scaling,
        b.cores_scaling,
    )
