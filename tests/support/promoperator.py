"""A model of the scrape configuration prometheus-operator generates for a ServiceMonitor, and of
the target labels Prometheus's Kubernetes service discovery (role `endpoints`) gives a pod behind
a Service, so a real Prometheus can scrape a local process exactly as it would in a cluster.

Written from prometheus-operator's pkg/prometheus/promcfg.go (ConfigGenerator
.generateServiceMonitorConfig, initRelabelings, generateRunningFilter, generateRelabelConfig,
appendShardingRelabelingWithAddress; compare pkg/prometheus/testdata/
ServiceMonitorObjectWithMatchLabelSelector.golden) and Prometheus's discovery/kubernetes/
endpoints.go (Endpoints.buildEndpoints), pod.go (podLabels) and service.go (serviceLabels).

Only what the chart's ServiceMonitor uses is modelled: matchLabels, one namespace, `port`, `path`,
`interval`, `scrapeTimeout`, `honorLabels`, `relabelings`.  The one difference from a cluster:
`static_configs` carrying the discovery's `__meta_kubernetes_*` labels stand in for
`kubernetes_sd_configs` (relabelling sees the same labels; both are dropped after it).
"""

from __future__ import annotations

import re
from typing import Any


def sanitize(name: str) -> str:
    """promcfg.go sanitizeLabelName / Prometheus strutil.SanitizeLabelName."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def scrape_config(sm: dict[str, Any], index: int = 0, shard: int = 0) -> dict[str, Any]:
    """The scrape_config of endpoint `index` of ServiceMonitor `sm` (shard `shard` of 1)."""
    meta, spec = sm["metadata"], sm["spec"]
    ep = spec["endpoints"][index]
    cfg: dict[str, Any] = {
        "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}",
        # AddHonorLabels: honor_labels is always written, false unless the endpoint says true
        "honor_labels": bool(ep.get("honorLabels", False)),
    }
    for key, field in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"), ("path", "metrics_path")):
        if ep.get(key):
            cfg[field] = ep[key]
    # initRelabelings
    rel: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    # the Service selector, SelectorMechanismRelabel (the default): exact label matches
    for k in sorted(spec["selector"].get("matchLabels", {})):
        v = spec["selector"]["matchLabels"][k]
        rel.append(
            {
                "action": "keep",
                "source_labels": [f"__meta_kubernetes_service_label_{sanitize(k)}",
                                  f"__meta_kubernetes_service_labelpresent_{sanitize(k)}"],
                "regex": f"({v});true",
            }
        )  # fmt: skip
    if ep.get("port"):
        rel.append({"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": ep["port"]})
    kind_name = ["__meta_kubernetes_endpoint_address_target_kind", "__meta_kubernetes_endpoint_address_target_name"]
    rel += [
        {"source_labels": kind_name, "separator": ";", "regex": "Node;(.*)", "replacement": "${1}",
         "target_label": "node"},
        {"source_labels": kind_name, "separator": ";", "regex": "Pod;(.*)", "replacement": "${1}",
         "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        # generateRunningFilter (filterRunning defaults to true)
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        # the job: the Service's name
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
    ]  # fmt: skip
    if ep.get("port"):
        rel.append({"target_label": "endpoint", "replacement": ep["port"]})
    # the endpoint's own relabelings (generateRelabelConfig: camelCase fields to snake_case)
    for r in ep.get("relabelings", []):
        out: dict[str, Any] = {}
        if r.get("sourceLabels"):
            out["source_labels"] = r["sourceLabels"]
        for src, dst in (("separator", "separator"), ("targetLabel", "target_label"), ("regex", "regex"),
                         ("modulus", "modulus"), ("replacement", "replacement"), ("action", "action")):  # fmt: skip
            if r.get(src) not in (None, ""):
                out[dst] = r[src]
        rel.append(out)
    # appendShardingRelabelingWithAddress; the config-reloader substitutes $(SHARD)
    rel += [
        {"source_labels": ["__address__", "__tmp_hash"], "target_label": "__tmp_hash", "regex": "(.+);",
         "replacement": "$1", "action": "replace"},
        {"source_labels": ["__tmp_hash"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
        {"source_labels": ["__tmp_hash", "__tmp_disable_sharding"], "regex": f"{shard};|.+;.+", "action": "keep"},
    ]  # fmt: skip
    cfg["relabel_configs"] = rel
    return cfg


def endpoints_target(
    service: dict[str, Any], pod: dict[str, Any], address: str, node: str, port_name: str
) -> dict[str, str]:
    """The labels Kubernetes SD (role endpoints) gives the address of `pod` behind `service`:
    buildEndpoints' target and group labels, serviceLabels, podLabels, the container port."""
    labels: dict[str, str] = {
        "__address__": address,
        "__meta_kubernetes_namespace": service["metadata"]["namespace"],
        "__meta_kubernetes_endpoints_name": service["metadata"]["name"],
        "__meta_kubernetes_endpoint_port_name": port_name,
        "__meta_kubernetes_endpoint_port_protocol": "TCP",
        "__meta_kubernetes_endpoint_ready": "true",
        "__meta_kubernetes_endpoint_address_target_kind": "Pod",
        "__meta_kubernetes_endpoint_address_target_name": pod["metadata"]["name"],
        "__meta_kubernetes_endpoint_node_name": node,
        "__meta_kubernetes_service_name": service["metadata"]["name"],
        "__meta_kubernetes_pod_name": pod["metadata"]["name"],
        "__meta_kubernetes_pod_ip": address.rsplit(":", 1)[0],
        "__meta_kubernetes_pod_ready": "true",
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_node_name": node,
        "__meta_kubernetes_pod_host_ip": address.rsplit(":", 1)[0],
    }
    for k, v in (service["metadata"].get("labels") or {}).items():
        labels[f"__meta_kubernetes_service_label_{sanitize(k)}"] = str(v)
        labels[f"__meta_kubernetes_service_labelpresent_{sanitize(k)}"] = "true"
    for k, v in (pod["metadata"].get("labels") or {}).items():
        labels[f"__meta_kubernetes_pod_label_{sanitize(k)}"] = str(v)
        labels[f"__meta_kubernetes_pod_labelpresent_{sanitize(k)}"] = "true"
    for ref in pod["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            labels["__meta_kubernetes_pod_controller_kind"] = ref["kind"]
            labels["__meta_kubernetes_pod_controller_name"] = ref["name"]
    # the container port whose number is the endpoint's port (buildEndpoints: port.Port == cport.ContainerPort)
    port = int(address.rsplit(":", 1)[1])
    for c in pod["spec"]["containers"]:
        for cport in c.get("ports", []):
            if int(cport["containerPort"]) != port:
                continue
            labels["__meta_kubernetes_pod_container_name"] = c["name"]
            labels["__meta_kubernetes_pod_container_image"] = c.get("image", "")
            labels["__meta_kubernetes_pod_container_port_name"] = cport.get("name", "")
            labels["__meta_kubernetes_pod_container_port_number"] = str(port)
            labels["__meta_kubernetes_pod_container_port_protocol"] = "TCP"
            labels["__meta_kubernetes_pod_container_init"] = "false"
            break
    return labels
