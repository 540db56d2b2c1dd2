"""Node inventory annotation (contract: vgpu/scheduling.py `NodeInventory`, version 2).

`inventory()` builds the document (pure, given the time); `NodeAnnotator` patches the Node
through the kubernetes client when an API server is reachable (in-cluster service account or
kubeconfig), and otherwise says so once and does nothing. The document carries a `heartbeat`
(unix seconds): the annotator re-patches it every `heartbeat_s` even when nothing else changed,
so the scheduler can tell a live plugin from a dead one (it stops offering a node whose
heartbeat is older than its `stale_after_s`).

With a usage source (device_plugin/usage.py) the same PATCH carries `vgpu.k8s.io/node-usage`,
what the node handed out: with the inventory, and on its own when it changed, at most once per
`usage_interval_s` (a burst of Allocates is one write). The PATCH's answer is the Node: when
its status lacks the node-level GPU totals kube-scheduler counts (vgpu.scheduling.node_capacity:
never published, or zeroed by a kubelet that re-registered the Node), they are written to the
status subresource (capacity and allocatable; the kubelet keeps extended resources it does not
manage, nodestatus/setters.go MachineInfo).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from nodecore.devices import DeviceTable
from vgpu import kube, scheduling
from vgpu.scheduling import InventoryGPU, NodeInventory, NodeUsage

log = logging.getLogger(__name__)

ANNOTATION = scheduling.INVENTORY_ANNOTATION
INVENTORY_VERSION = scheduling.INVENTORY_VERSION
USAGE_INTERVAL_S = 1.0  # at most one usage-only PATCH per node this often


def inventory(
    table: DeviceTable, resource_name: str, now: float, mig: dict[str, scheduling.MigGPU] | None = None
) -> NodeInventory:
    """`mig`: the GPUs that make MIG instances per container (device_plugin/dynmig.py) and their
    profiles and instances; with any, the inventory is version 3."""
    s = table.slicing
    gpus = []
    for st in table.gpus.values():
        g = st.info
        m = (mig or {}).get(g.uuid)
        gpus.append(
            InventoryGPU(
                uuid=g.uuid,
                index=g.index,
                model=g.name,
                memory=g.memory_total,
                memory_schedulable=s.memory_capacity(g.memory_total),
                cores=s.cores_capacity,
                split_count=len(st.ids),
                numa=-1 if g.numa_node is None else g.numa_node,
                health=table.is_healthy(g.uuid),
                **({"mig": m} if m is not None else {}),
            )
        )
    return NodeInventory(
        version=scheduling.INVENTORY_VERSION_MIG if mig else INVENTORY_VERSION,
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
    """A CoreV1Api, or None when no API server configuration exists (vgpu.kube's rule)."""
    try:
        api = kube.load()
    except kube.KubeConfigError as e:
        log.info("%s", e)
        return None
    if api is None:
        log.info("no kubeconfig and no in-cluster environment: node annotations are not published")
        return None
    from kubernetes import client

    return client.CoreV1Api(api)


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
        usage: Callable[[float], NodeUsage] | None = None,
        usage_interval_s: float = USAGE_INTERVAL_S,
        on_client: Callable[[Any], None] | None = None,
        mig: Callable[[], dict[str, scheduling.MigGPU]] | None = None,
    ) -> None:
        self.mig = mig  # dynamic MIG: the GPUs' profiles and instances now (device_plugin/dynmig.py)
        self.table = table
        self.resource_name = resource_name
        self.node = node
        self.heartbeat_s = heartbeat_s
        self.usage = usage
        self.usage_interval_s = usage_interval_s
        self.on_client = on_client  # called once with the API client (usage tags from the API)
        self.pending = False  # a usage change waits for usage_interval_s
        self._last_usage: list[scheduling.UsedSlice] | None = None
        self._usage_at = -1e18
        self._capacity_warned = False
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
                if self.on_client is not None:
                    self.on_client(self._api)
            now = time.time() if now is None else now
            inv = inventory(self.table, self.resource_name, now, self.mig() if self.mig is not None else None)
            last = self._last
            inv_due = last is None or not _same(last, inv) or now - last.heartbeat >= self.heartbeat_s
            used = self.usage(now) if self.usage is not None else None
            used_changed = used is not None and used.slices != self._last_usage
            if used_changed and not inv_due and now - self._usage_at < self.usage_interval_s:
                self.pending = True  # published on a later call, with whatever changed meanwhile
                return True
            if not inv_due and not used_changed:
                self.pending = False
                return True
            ann: dict[str, str] = {}
            if inv_due:
                ann[ANNOTATION] = scheduling.encode(inv)
            if used is not None and (inv_due or used_changed):
                ann[scheduling.USAGE_ANNOTATION] = scheduling.encode(used)
            try:
                answer = self._api.patch_node(
                    self.node, {"metadata": {"annotations": ann}}, _request_timeout=10, _preload_content=False
                )
                node = json.loads(answer.data)
            except Exception as e:  # ApiException, connection errors, an answer that is not JSON
                if not self._warned:
                    log.warning("cannot annotate node %s: %s", self.node, str(e).splitlines()[0] if str(e) else e)
                    self._warned = True
                return False
            if used is not None:
                self._last_usage, self._usage_at, self.pending = used.slices, now, False
            if inv_due:
                changed = last is None or not _same(last, inv)
                self._last = inv
                (log.info if changed else log.debug)("node %s annotated with the GPU inventory", self.node)
            self._warned = False
            self._capacity(inv, node if isinstance(node, dict) else {})
            return True

    def _capacity(self, inv: NodeInventory, node: dict[str, Any]) -> None:
        """Write the node-level totals to the Node's status when the Node (the PATCH's answer) lacks them."""
        want = {k: str(v) for k, v in scheduling.node_capacity(inv).items()}
        status = node.get("status") or {}
        have_cap, have_alloc = status.get("capacity") or {}, status.get("allocatable") or {}
        if all(str(have_cap.get(k)) == v and str(have_alloc.get(k)) == v for k, v in want.items()):
            return
        assert self._api is not None
        body = {"status": {"capacity": want, "allocatable": want}}
        try:
            self._api.patch_node_status(self.node, body, _request_timeout=10, _preload_content=False)
        except Exception as e:  # no RBAC for nodes/status, connection errors: the heartbeat retries
            if not self._capacity_warned:
                log.warning(
                    "cannot write the node-level GPU totals to node %s's status (preemption by GPU memory "
                    "is not possible there): %s",
                    self.node,
                    str(e).splitlines()[0] if str(e) else e,
                )
                self._capacity_warned = True
            return
        self._capacity_warned = False
        log.info("node %s: status capacity %s", self.node, want)


def _same(a: NodeInventory, b: NodeInventory) -> bool:
    """Equal but for the heartbeat."""
    return a.gpus == b.gpus and (a.resource, a.split_count, a.memory_scaling, a.cores_scaling) == (
        b.resource,
        b.split_count,
        b.memory_scaling,
        b.cores_scaling,
    )
