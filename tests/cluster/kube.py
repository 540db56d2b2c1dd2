"""The acceptance suite's view of a cluster: settings from the environment, the kubernetes client,
pods built the way users write them, and waiting on what the cluster reports.

Nothing here assumes a GPU model, a node name or a size: the tests read the nodes' inventories
(`vgpu.k8s.io/node-inventory`) and the usage `vgpuctl cluster` computes (`vgpuctl.cluster.view`).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.support.poll import wait_for
from vgpu import __version__
from vgpu import scheduling as sc
from vgpuctl import cluster as vcluster

MiB = 1 << 20
T = TypeVar("T")
Obj = dict[str, Any]

# The container of every test pod: what it sees of its GPUs (one JSON line), then it stays up
# (holding its slice) until it is told to stop. `sh` with a TERM trap ends at once on deletion.
HOLD = "vgpuctl slice; trap 'exit 0' TERM; sleep infinity & wait"


@dataclass(frozen=True)
class Settings:
    """Everything the suite takes from the environment (docs/operators/install.md, "Acceptance suite")."""

    kubeconfig: str
    namespace_prefix: str = "vgpu-test"
    runtime_class: str = "vgpu"  # "" = the cluster's default handler applies the slices
    scheduler_name: str = "vgpu-scheduler"
    image: str = f"ghcr.io/k8s-vgpu/k8s-vgpu:{__version__}"
    pull_policy: str = "IfNotPresent"
    resource: str = sc.RESOURCE_GPU
    timeout_s: float = 180.0
    node: str = ""  # the node whole-node tests use ("" = the first one with every GPU free)
    kubelet_restart: str = ""  # shell command restarting the kubelet of $NODE ("" = skip that test)
    disruptive: bool = False  # may take the webhook down (scale the scheduler to 0) and back
    host_network: bool = False  # test pods on the host network (clusters without a pod network)
    refuse_oversized: bool = False  # the chart's scheduler.webhook.refuseOversized

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings | None:
        e = os.environ if env is None else env
        kc = e.get("KUBECONFIG", "")
        if not kc:
            return None
        d = cls(kubeconfig=kc)
        return cls(
            kubeconfig=kc,
            namespace_prefix=e.get("VGPU_TEST_NAMESPACE_PREFIX", d.namespace_prefix),
            runtime_class=e.get("VGPU_TEST_RUNTIME_CLASS", d.runtime_class),
            scheduler_name=e.get("VGPU_TEST_SCHEDULER_NAME", d.scheduler_name),
            image=e.get("VGPU_TEST_IMAGE", d.image),
            pull_policy=e.get("VGPU_TEST_PULL_POLICY", d.pull_policy),
            resource=e.get("VGPU_TEST_RESOURCE_NAME", d.resource),
            timeout_s=float(e.get("VGPU_TEST_TIMEOUT_S", d.timeout_s)),
            node=e.get("VGPU_TEST_NODE", d.node),
            kubelet_restart=e.get("VGPU_TEST_KUBELET_RESTART", d.kubelet_restart),
            disruptive=e.get("VGPU_TEST_DISRUPTIVE", "") in ("1", "true", "yes"),
            host_network=e.get("VGPU_TEST_HOST_NETWORK", "") in ("1", "true", "yes"),
            refuse_oversized=e.get("VGPU_TEST_REFUSE_OVERSIZED", "") in ("1", "true", "yes"),
        )


def wait(pred: Callable[[], T | None], timeout: float, what: str, every: float = 0.5) -> T:
    """Poll `pred` until it returns something true, every `every` s (a real API server's pace);
    AssertionError naming `what` on timeout (tests.support.poll.wait_for)."""
    return wait_for(pred, timeout, what, step=every)


class Cluster:
    """The API of the cluster under test and the namespace of this run."""

    def __init__(self, settings: Settings) -> None:
        from kubernetes import client

        self.settings = settings
        self.core = vcluster.load_api(settings.kubeconfig)
        self.api_client = self.core.api_client
        self.apps = client.AppsV1Api(self.api_client)
        self.scheduling = client.SchedulingV1Api(self.api_client)
        self.namespace = f"{settings.namespace_prefix}-{secrets.token_hex(3)}"

    # ---- raw JSON reads (the objects exactly as the API server stores them) ----
    def _json(self, resp: Any) -> Any:
        return json.loads(resp.data)

    def nodes(self) -> list[Obj]:
        items: list[Obj] = self._json(self.core.list_node(_preload_content=False))["items"]
        return items

    def node(self, name: str) -> Obj:
        n: Obj = self._json(self.core.read_node(name, _preload_content=False))
        return n

    def pod(self, name: str) -> Obj | None:
        from kubernetes.client.rest import ApiException

        try:
            p: Obj = self._json(self.core.read_namespaced_pod(name, self.namespace, _preload_content=False))
            return p
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, label_selector: str = "") -> list[Obj]:
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=label_selector, _preload_content=False)
        items: list[Obj] = self._json(resp)["items"]
        return items

    def view(self) -> vcluster.ClusterView:
        """What `vgpuctl cluster` shows: every GPU's allocated and free memory, cores and slots."""
        nodes, pods = vcluster.fetch(self.core)
        return vcluster.view(nodes, pods, time.time())

    def events(self, name: str, reason: str = "") -> list[str]:
        evs = self._json(
            self.core.list_namespaced_event(
                self.namespace, field_selector=f"involvedObject.name={name}", _preload_content=False
            )
        )["items"]
        return [e.get("message") or "" for e in evs if not reason or e.get("reason") == reason]

    def all_events(self, reason: str) -> list[Obj]:
        """Every event of this run's namespace with that reason, as the API returns it."""
        evs: list[Obj] = self._json(self.core.list_namespaced_event(self.namespace, _preload_content=False))["items"]
        return [e for e in evs if e.get("reason") == reason]

    def condition(self, name: str, kind: str = "PodScheduled") -> Obj:
        p = self.pod(name)
        assert p is not None, f"pod {name} is gone"
        found = [c for c in (p.get("status") or {}).get("conditions") or [] if c.get("type") == kind]
        return found[0] if found else {}

    # ---- writes ----
    def create_namespace(self) -> None:
        self.core.create_namespace({"metadata": {"name": self.namespace, "labels": {"vgpu.k8s.io/test": "cluster"}}})

    def delete_namespace(self, timeout: float) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespace(self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise

        def gone() -> bool:
            try:
                self.core.read_namespace(self.namespace)
            except ApiException as e:
                return e.status == 404
            return False

        wait(gone, timeout, f"namespace {self.namespace} to be deleted", every=1.0)

    def create_pod(self, body: Obj) -> Obj:
        resp = self.core.create_namespaced_pod(self.namespace, body, _preload_content=False)
        created: Obj = self._json(resp)
        return created

    def delete_pod(self, name: str, grace: int | None = None) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)
        except ApiException as e:
            if e.status != 404:
                raise

    def create_priority_class(self, name: str, value: int) -> None:
        self.scheduling.create_priority_class(
            {  # type: ignore[arg-type]  # a dict body is sent as it is
                "metadata": {"name": name, "labels": {"vgpu.k8s.io/test": self.namespace}},
                "value": value,
                "preemptionPolicy": "PreemptLowerPriority",
                "description": f"k8s-vgpu acceptance suite, namespace {self.namespace}",
            }
        )

    def delete_priority_classes(self) -> None:
        sel = f"vgpu.k8s.io/test={self.namespace}"
        for pc in self._json(self.scheduling.list_priority_class(label_selector=sel, _preload_content=False))["items"]:
            self.scheduling.delete_priority_class(pc["metadata"]["name"])

    def deployments(self, label_selector: str) -> list[Obj]:
        resp = self.apps.list_deployment_for_all_namespaces(label_selector=label_selector, _preload_content=False)
        items: list[Obj] = self._json(resp)["items"]
        return items

    def deployment(self, namespace: str, name: str) -> Obj:
        d: Obj = self._json(self.apps.read_namespaced_deployment(name, namespace, _preload_content=False))
        return d

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": replicas}})

    # ---- waiting on pods ----
    def wait_running(self, name: str, timeout: float | None = None) -> Obj:
        def running() -> Obj | None:
            p = self.pod(name)
            if p is None:
                raise AssertionError(f"pod {name} is gone")
            phase = p["status"].get("phase")
            if phase in ("Failed", "Succeeded"):
                raise AssertionError(f"pod {name} ended: {phase}\n{self.describe(name)}")
            return p if phase == "Running" else None

        try:
            return wait(running, timeout or self.settings.timeout_s, f"pod {name} to run")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe(name)}") from None

    def wait_finished(self, name: str, timeout: float | None = None) -> Obj:
        def done() -> Obj | None:
            p = self.pod(name)
            return p if p and p["status"].get("phase") in ("Succeeded", "Failed") else None

        try:
            return wait(done, timeout or self.settings.timeout_s, f"pod {name} to finish")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe(name)}") from None

    def wait_failed_scheduling(self, name: str, timeout: float | None = None) -> list[str]:
        """The FailedScheduling messages of a pod that is still Pending and unbound."""

        def reasons() -> list[str] | None:
            p = self.pod(name)
            assert p is not None, f"pod {name} is gone"
            assert not p["spec"].get("nodeName"), f"pod {name} was bound to {p['spec'].get('nodeName')}"
            return self.events(name, "FailedScheduling") or None

        return wait(reasons, timeout or self.settings.timeout_s, f"a FailedScheduling event of {name}")

    def wait_gone(self, names: list[str], timeout: float | None = None) -> None:
        wait(
            lambda: all(self.pod(n) is None for n in names),
            timeout or self.settings.timeout_s,
            f"pods {names} to be gone",
        )

    def logs(self, name: str) -> str:
        text: str = self.core.read_namespaced_pod_log(name, self.namespace)
        return text

    def seen(self, name: str, timeout: float = 60.0) -> Obj:
        """The `vgpuctl slice` line the pod's container printed: {"cuda": ..., "nvml": ...}."""

        from kubernetes.client.rest import ApiException

        def line() -> Obj | None:
            try:
                text = self.logs(name)
            except ApiException:  # not yet, or a kubelet that restarts: it lists its pods again first
                return None
            for ln in text.splitlines():
                if ln.startswith("{"):
                    out: Obj = json.loads(ln)
                    return out
            return None

        return wait(line, timeout, f"the slice line in {name}'s log")

    def describe(self, name: str) -> str:
        p = self.pod(name)
        if p is None:
            return f"pod {name}: gone"
        st = p.get("status") or {}
        lines = [
            f"pod {name}: phase {st.get('phase')} node {p['spec'].get('nodeName')} "
            f"scheduler {p['spec'].get('schedulerName')} nominated {st.get('nominatedNodeName')}",
            f"  annotations: {json.dumps((p['metadata'].get('annotations') or {}), sort_keys=True)}",
        ]
        for c in st.get("conditions") or []:
            lines.append(f"  condition {c.get('type')}={c.get('status')} {c.get('reason', '')} {c.get('message', '')}")
        for cs in st.get("containerStatuses") or []:
            lines.append(f"  container {cs.get('name')}: {json.dumps(cs.get('state'))}")
        for m in self.events(name):
            lines.append(f"  event: {m}")
        return "\n".join(lines)


def decision(pod: Obj) -> sc.Decision | None:
    text = (pod["metadata"].get("annotations") or {}).get(sc.DECISION_ANNOTATION)
    return sc.decode_decision(text) if text else None


def limits_of(pod: Obj, container: str = "main") -> dict[str, str]:
    [c] = [c for c in pod["spec"]["containers"] if c["name"] == container]
    out: dict[str, str] = (c.get("resources") or {}).get("limits") or {}
    return out


def on_node(node: str) -> Obj:
    """Required node affinity on the node's name (matchFields: exact, whatever its labels)."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def pod_body(
    s: Settings,
    name: str,
    limits: dict[str, str],
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    node: str = "",
    priority_class: str = "",
    scheduler_name: str = "",
    command: list[str] | None = None,
    restart_policy: str = "Always",
) -> Obj:
    """A pod as a user writes it: resources in limits only, no schedulerName (the webhook sets it)."""
    spec: Obj = {
        "restartPolicy": restart_policy,
        "terminationGracePeriodSeconds": 5,
        "tolerations": [{"key": s.resource, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": "main",
                "image": s.image,
                "imagePullPolicy": s.pull_policy,
                "command": command or ["sh", "-c", HOLD],
                "resources": {"limits": dict(limits)},
            }
        ],
    }
    if s.runtime_class:
        spec["runtimeClassName"] = s.runtime_class
    if s.host_network:
        spec["hostNetwork"] = True
    if node:
        spec["affinity"] = on_node(node)
    if priority_class:
        spec["priorityClassName"] = priority_class
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    meta: Obj = {"name": name, "labels": {"vgpu.k8s.io/test": "cluster", **(labels or {})}}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def offered_gpus(v: vcluster.ClusterView) -> list[tuple[str, vcluster.GPURow]]:
    """(node, GPU) of every healthy GPU of a node the scheduler offers."""
    return [(n.name, g) for n in v.nodes if not n.problem for g in n.gpus if g.healthy]


def gpu_is_free(g: vcluster.GPURow) -> bool:
    return g.memory_allocated == 0 and g.slots_allocated == 0 and g.cores_allocated == 0
