"""Node inventory annotation: a JSON summary of the node's GPUs on its Node object.

`build()` makes the JSON (pure); `NodeAnnotator` patches the Node through the
kubernetes client when an API server is reachable (in-cluster service account
or kubeconfig), and otherwise says so once and does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any

from device_plugin.devices import DeviceTable

log = logging.getLogger(__name__)

ANNOTATION = "vgpu.k8s.io/node-inventory"
INVENTORY_VERSION = 1


def build(table: DeviceTable, resource_name: str) -> str:
    s = table.slicing
    gpus = []
    for st in table.gpus.values():
        g = st.info
        gpus.append(
            {
                "uuid": g.uuid,
                "index": g.index,
                "model": g.name,
                "memory": g.memory_total,
                "numa": g.numa_node,
                "health": "Healthy" if st.healthy else "Unhealthy",
                "vgpus": len(st.ids),
                "vgpu_memory": s.memory_per_vgpu(g.memory_total),
                "vgpu_cores": s.cores_for(1),
            }
        )
    doc = {
        "version": INVENTORY_VERSION,
        "resource": resource_name,
        "split_count": s.split_count,
        "memory_scaling": s.memory_scaling,
        "cores_scaling": s.cores_scaling,
        "gpus": gpus,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def node_name(configured: str) -> str:
    return configured or os.environ.get("NODE_NAME") or socket.gethostname()


def _load_client() -> Any | None:
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
    """Publishes the inventory annotation; thread-safe, never raises."""

    def __init__(self, table: DeviceTable, resource_name: str, node: str) -> None:
        self.table = table
        self.resource_name = resource_name
        self.node = node
        self._api: Any | None = None
        self._disabled = False
        self._lock = threading.Lock()
        self._last: str | None = None
        self._warned = False

    def publish(self) -> bool:
        """Patch the Node if the inventory changed; True when the Node holds it."""
        with self._lock:
            if self._disabled:
                return False
            if self._api is None:
                try:
                    self._api = _load_client()
                except Exception as e:
                    log.warning("kubernetes client unavailable: %s", e)
                    self._api = None
                if self._api is None:
                    self._disabled = True
                    log.warning("no Kubernetes API server configured; node inventory annotation disabled")
                    return False
            doc = build(self.table, self.resource_name)
            if doc == self._last:
                return True
            body = {"metadata": {"annotations": {ANNOTATION: doc}}}
            try:
                self._api.patch_node(self.node, body, _request_timeout=10)
            except Exception as e:  # ApiException, connection errors
                if not self._warned:
                    log.warning("cannot annotate node %s: %s", self.node, str(e).splitlines()[0] if str(e) else e)
                    self._warned = True
                return False
            self._last = doc
            self._warned = False
            log.info("node %s annotated with the GPU inventory", self.node)
            return True
