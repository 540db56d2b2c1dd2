"""What the effective containerd config and the toolkit config mean, decided from what was
read (pure): the runtime handlers, the NVIDIA one install copies, whether the CRI plugin loads,
and the node type."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable
from typing import Any

from node_setup.nodetype.facts import NVIDIA_BINARIES, OPERATOR_TOOLKIT, Handler, NodeType, ToolkitConfig, version_tuple
from node_setup.nodetype.tomlmerge import as_dict
from node_setup.nodetype.toolkit import beside, runtime_mode


def is_nvidia(name: str, binary: str) -> bool:
    base = os.path.basename(binary)
    return name.startswith("nvidia") or any(base.startswith(b) for b in NVIDIA_BINARIES)


def handlers_of(ctd: dict[str, Any], raw_ctd: dict[str, Any] | None, exists: Callable[[str], bool]) -> list[Handler]:
    """The `runtimes` tables of an effective `containerd` section, by name.  `raw_ctd`: the same
    section as the files have it (a dump adds every default); `exists(host path)`: whether a
    binary is there."""
    out = []
    runtimes: dict[str, Any] = as_dict(ctd.get("runtimes"))
    raw_rts: dict[str, Any] = as_dict(raw_ctd.get("runtimes")) if raw_ctd else {}
    for name, t in sorted(runtimes.items()):
        if not isinstance(t, dict):
            continue
        # The table as the admin/toolkit wrote it where the files have it (a dump adds every default).
        raw = raw_rts.get(name)
        table: dict[str, Any] = raw if isinstance(raw, dict) else t
        opts = as_dict(t.get("options"))
        binary = str(opts.get("BinaryName") or "")
        ann = t.get("container_annotations")
        out.append(
            Handler(
                name=name,
                runtime_type=str(t.get("runtime_type") or ""),
                binary_name=binary,
                base_runtime_spec=str(t.get("base_runtime_spec") or ""),
                container_annotations=[a for a in ann if isinstance(a, str)] if isinstance(ann, list) else [],
                nvidia=is_nvidia(name, binary),
                binary_exists=exists(binary) if binary.startswith("/") else bool(binary),
                table=copy.deepcopy(table),
            )
        )
    return out


def pick_nvidia(handlers: list[Handler], default: str, exclude: str) -> Handler | None:
    """The handler install copies: the default if it is NVIDIA's, else `nvidia`, else another nvidia*."""
    nv = [h for h in handlers if h.nvidia and h.name != exclude and not is_vgpu_table(h.table)]
    for pick in (
        lambda h: h.name == default,
        lambda h: h.name == "nvidia",
        lambda h: not h.binary_name.endswith((".cdi", ".legacy")),
        lambda h: True,
    ):
        for h in nv:
            if pick(h):
                return h
    return None


def is_vgpu_table(table: dict[str, Any]) -> bool:
    ann = table.get("container_annotations")
    return isinstance(ann, list) and "vgpu.k8s.io/*" in ann


def legacy_sibling(binary: str) -> str:
    """The `.legacy` runtime beside a BinaryName (`x.cdi` -> `x.legacy`; "" for none or a `.legacy`)."""
    if binary.endswith(".cdi"):
        return binary[: -len(".cdi")] + ".legacy"
    return binary + ".legacy" if binary and not binary.endswith(".legacy") else ""


def cri_load_error(facts_major: int, ctd: dict[str, Any]) -> str:
    """Why the CRI plugin refuses this effective `containerd` section, "" when it loads: the
    default runtime must be one of `runtimes` (pkg/cri/config/config.go@v1.7.34:
    ValidatePluginConfig; internal/cri/config/config.go@v2.3.4: ValidateRuntimeConfig).
    containerd then runs without CRI and the kubelet cannot start any pod."""
    name = ctd.get("default_runtime_name")
    if facts_major >= 2 and name == "":
        return "`default_runtime_name` is empty"
    name = name or "runc"
    configured = ctd.get("runtimes")
    runtimes: dict[str, Any] = dict(configured) if isinstance(configured, dict) else {}
    if facts_major >= 2 or not isinstance(configured, dict):
        # containerd's built-in `runc`: 1.x keeps it only while no file defines a `runtimes`
        # table (1.6.20 and 1.7.34 `config dump` of a file defining only `vgpu`: runc gone); 2.x
        # merges the configured runtimes into its defaults (2.3.4: runc kept).
        runtimes.setdefault("runc", {})
    if name not in runtimes:
        return (
            f"no corresponding runtime configured in `containerd.runtimes` for `containerd` "
            f'`default_runtime_name = "{name}"'  # containerd's message, unbalanced backtick included
        )
    return ""


def node_type(nv: Handler, tk: ToolkitConfig, toolkit_version: str, files: Iterable[str]) -> NodeType:
    """The node type (see the package doc) of the NVIDIA handler `nv` reading `tk`; `files`: the
    containerd config files in merge order."""
    mode = runtime_mode(nv.binary_name, tk)
    operator = nv.binary_name.startswith(OPERATOR_TOOLKIT + "/") or tk.path == beside(nv.binary_name)
    if mode == "cdi":
        return "N3" if operator else "N1-cdi"
    if operator:
        return "N2"  # the GPU Operator's toolkit (wrappers + config under its toolkit dir)
    if mode == "legacy":
        return "N1-legacy"
    if mode == "jit-cdi":
        return "N1-jit-cdi"
    # `auto`: <= 1.17 resolves to legacy, >= 1.18 to jit-cdi (internal/info/auto.go).  Without
    # `nvidia-ctk --version`, the 1.18 drop-in (conf.d/99-nvidia.toml) is the tell.
    if toolkit_version:
        return "N1-jit-cdi" if version_tuple(toolkit_version) >= (1, 18) else "N1-legacy"
    if any(os.path.basename(p) == "99-nvidia.toml" for p in files):
        return "N1-jit-cdi"
    return "N1-legacy"
