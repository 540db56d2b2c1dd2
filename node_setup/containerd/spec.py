"""The base runtime spec the vgpu handler names: containerd's default spec as CRI uses it for a
handler without one, plus our hooks (pure; reading the default spec is apply's)."""

from __future__ import annotations

import json
from typing import Any

from node_setup.hookspec import is_ours


def without_default_security(spec: dict[str, Any]) -> dict[str, Any]:
    """containerd's default spec as CRI uses it for a handler WITHOUT base_runtime_spec.

    CRI starts such a container from the same default spec `ctr oci spec` prints, then clears
    its default rlimits (RLIMIT_NOFILE 1024), AppArmor profile and seccomp
    (pkg/cri/opts/spec_opts.go@v1.7.34 and internal/cri/opts/spec_opts.go@v2.3.4:
    WithoutDefaultSecuritySettings) - but only when the handler has no base_runtime_spec
    (container_create_linux.go: "Admins can use this functionality to define default ulimits").
    Our base spec exists only to carry the hooks, so it must not bring those defaults back: a
    vGPU container's spec equals a plain container's but for our hooks and annotations
    (recorded: containerd-cri/cri-handler-runc-base.config.json has RLIMIT_NOFILE 1024/1024, the
    handler without a base spec none)."""
    spec = json.loads(json.dumps(spec))
    proc = spec.get("process")
    if isinstance(proc, dict):
        proc.pop("rlimits", None)
        proc.pop("apparmorProfile", None)
    linux = spec.get("linux")
    if isinstance(linux, dict):
        linux.pop("seccomp", None)
    return spec


def with_hooks(spec: dict[str, Any], entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    hooks = spec.setdefault("hooks", {})
    for kind, entry in entries.items():
        lst = [h for h in hooks.get(kind) or [] if not is_ours(h)]
        lst.append(entry)
        hooks[kind] = lst
    return spec
