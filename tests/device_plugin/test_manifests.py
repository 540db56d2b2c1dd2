"""The DaemonSet and RBAC manifests are valid YAML and agree with the plugin's needs."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "packaging" / "k8s"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_daemonset_mounts_and_flags() -> None:
    (ds,) = _docs("device-plugin.yaml")
    assert ds["kind"] == "DaemonSet"
    pod = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host["device-plugins"] == "/var/lib/kubelet/device-plugins"
    # The plugin reads the kubelet's device checkpoint there; it needs no PodResources socket.
    assert "pod-resources" not in host
    assert host["vgpu-state"] == "/var/lib/vgpu"
    (c,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["device-plugins"] == host["device-plugins"]
    assert mounts["vgpu-state"] == host["vgpu-state"]
    assert c["command"] == ["vgpu-device-plugin"]
    assert "--kubelet-dir=/var/lib/kubelet" in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "system-node-critical"


def test_rbac_lets_the_service_account_patch_nodes() -> None:
    (ds,) = _docs("device-plugin.yaml")
    docs = {d["kind"]: d for d in _docs("rbac.yaml")}
    sa = docs["ServiceAccount"]["metadata"]
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["name"]
    assert ds["metadata"]["namespace"] == sa["namespace"]
    rules = docs["ClusterRole"]["rules"]
    assert any("nodes" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # scheduler decisions: Allocate lists its node's pods and annotates the one it serves
    assert any("pods" in r["resources"] and {"list", "patch"} <= set(r["verbs"]) for r in rules)
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]} in binding["subjects"]
