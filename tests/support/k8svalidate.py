"""Validate Kubernetes manifests against the kubernetes client's models.

`validate(obj)` deserialises a manifest into its model class (required fields and enums are
checked by the models), serialises it back, and compares: a misspelt or misplaced key, or a
value of the wrong type, does not survive the round trip and is reported by its path.
YAML is loaded with duplicate keys rejected (the API server rejects them too).
"""

from __future__ import annotations

from typing import Any

import yaml
from kubernetes import client

MODELS = {
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "Pod"): "V1Pod",
    ("apps/v1", "DaemonSet"): "V1DaemonSet",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): "V1MutatingWebhookConfiguration",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("node.k8s.io/v1", "RuntimeClass"): "V1RuntimeClass",
    ("batch/v1", "Job"): "V1Job",
    ("resource.k8s.io/v1", "DeviceClass"): "V1DeviceClass",
    ("resource.k8s.io/v1", "ResourceSlice"): "V1ResourceSlice",
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): "V1ResourceClaimTemplate",
}


class DuplicateKey(ValueError):
    pass


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise DuplicateKey(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_all(text: str) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML text."""
    return [d for d in yaml.load_all(text, Loader=_StrictLoader) if d]


def _diff(orig: Any, back: Any, path: str, out: list[str]) -> None:
    if isinstance(orig, dict):
        if not isinstance(back, dict):
            out.append(f"{path}: became {back!r}")
            return
        for k, v in orig.items():
            if k not in back:
                if v in ({}, [], None):
                    continue  # empty values are dropped by the serialiser, harmlessly
                out.append(f"{path}.{k}: unknown field")
            else:
                _diff(v, back[k], f"{path}.{k}", out)
    elif isinstance(orig, list):
        if not isinstance(back, list) or len(back) != len(orig):
            out.append(f"{path}: list changed")
            return
        for i, (a, b) in enumerate(zip(orig, back, strict=True)):
            _diff(a, b, f"{path}[{i}]", out)
    elif orig != back or type(orig) is not type(back):
        if isinstance(orig, int) and isinstance(back, float) and orig == back:
            return
        out.append(f"{path}: {orig!r} became {back!r}")


def validate(obj: dict[str, Any]) -> list[str]:
    """Problems of one manifest (empty: valid)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    model = MODELS.get(key)  # type: ignore[arg-type]
    if model is None:
        return [f"no model for {key}"]
    api = client.ApiClient()
    try:
        inst = api._ApiClient__deserialize(obj, model)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as e:
        return [f"{key[1]}: {e}"]
    back = api.sanitize_for_serialization(inst)
    problems: list[str] = []
    _diff(obj, back, key[1] or "", problems)
    return problems
