"""The NVIDIA container runtime's config: which config.toml a runtime binary reads (a wrapper's
NVIDIA_CTK_CONFIG_FILE_PATH, the GPU Operator's layout, the host default), what it says
(`parse_toolkit`, pure), the toolkit's version, and the mode a binary runs in."""

from __future__ import annotations

import os
from typing import Any

from node_setup.nodetype.facts import HOST_TOOLKIT_CONFIG, OPERATOR_TOOLKIT, OPERATOR_TOOLKIT_CONFIG, ToolkitConfig
from node_setup.nodetype.root import DetectError, Root
from node_setup.nodetype.tomlmerge import TOMLError, get_path, loads


def wrapper_config(root: Root, binary: str) -> str:
    """NVIDIA_CTK_CONFIG_FILE_PATH set by a shell wrapper (the operator installs these)."""
    try:
        with open(root.fs(binary), "rb") as f:
            head = f.read(16384)
    except OSError:
        return ""
    if not head.startswith(b"#!"):
        return ""
    for line in head.decode("utf-8", "replace").splitlines():
        i = line.find("NVIDIA_CTK_CONFIG_FILE_PATH=")
        if i < 0:
            continue
        v = line[i + len("NVIDIA_CTK_CONFIG_FILE_PATH=") :].strip().split()[0] if line[i:].strip() else ""
        v = v.strip("'\"")
        if v.startswith("/") and "$" not in v:
            return v
    return ""


def toolkit_config_path(root: Root, binary: str) -> str:
    """Which config.toml the runtime at `binary` reads (host path)."""
    if binary:
        wrapped = wrapper_config(root, binary)
        if wrapped:
            return wrapped
        if binary.startswith(OPERATOR_TOOLKIT + "/"):
            return OPERATOR_TOOLKIT_CONFIG
        found = beside(binary)
        if root.exists(found):
            return found
    return HOST_TOOLKIT_CONFIG


def beside(binary: str) -> str:
    """The operator installer's layout: <toolkit dir>/.config/nvidia-container-runtime/config.toml."""
    return os.path.join(os.path.dirname(binary), ".config", "nvidia-container-runtime", "config.toml")


def read_toolkit(root: Root, path: str) -> ToolkitConfig:
    """The toolkit config at host path `path` (defaults when absent; `error` set when unreadable)."""
    try:
        text = root.read(path)
    except DetectError as e:
        return ToolkitConfig(path=path, error=str(e))
    if text is None:
        return ToolkitConfig(path=path)
    return parse_toolkit(path, text)


def parse_toolkit(path: str, text: str) -> ToolkitConfig:
    """What a toolkit config.toml says, over the runtime's defaults (`error` when it does not parse)."""
    tk = ToolkitConfig(path=path, exists=True)
    try:
        doc = loads(text)
    except TOMLError as e:
        tk.error = f"cannot parse {path}: {e}"
        return tk
    rt = doc.get("nvidia-container-runtime") or {}
    cdi = get_path(rt, "modes", "cdi") or {}

    def strs(v: Any, default: list[str]) -> list[str]:
        return [x for x in v if isinstance(x, str)] if isinstance(v, list) else default

    if isinstance(rt.get("mode"), str):
        tk.mode = rt["mode"]
    tk.runtimes = strs(rt.get("runtimes"), tk.runtimes)
    if isinstance(cdi.get("default-kind"), str):
        tk.default_kind = cdi["default-kind"]
    tk.annotation_prefixes = strs(cdi.get("annotation-prefixes"), tk.annotation_prefixes)
    tk.spec_dirs = strs(cdi.get("spec-dirs"), tk.spec_dirs)
    v = doc.get("accept-nvidia-visible-devices-envvar-when-unprivileged")
    if isinstance(v, bool):
        tk.accept_envvar_unprivileged = v
    v = doc.get("accept-nvidia-visible-devices-as-volume-mounts")
    if isinstance(v, bool):
        tk.accept_volume_mounts = v
    if isinstance(doc.get("swarm-resource"), str):
        tk.swarm_resource = doc["swarm-resource"]
    hook = doc.get("nvidia-container-runtime-hook") or {}
    if isinstance(hook, dict) and isinstance(hook.get("skip-mode-detection"), bool):
        tk.skip_mode_detection = hook["skip-mode-detection"]
    return tk


def toolkit_version(root: Root, binary: str) -> str:
    """`nvidia-ctk --version` next to the runtime or in /usr/bin ("" when absent)."""
    for exe in (os.path.join(os.path.dirname(binary), "nvidia-ctk") if binary else "", "/usr/bin/nvidia-ctk"):
        if exe and root.exists(exe):
            r = root.run(exe, "--version", timeout=10)
            if r is not None and r.returncode == 0:
                for word in r.stdout.replace(",", " ").split():
                    w = word.lstrip("v")
                    if w[:1].isdigit() and "." in w:
                        return w
    return ""


def runtime_mode(binary: str, tk: ToolkitConfig | None) -> str:
    """The mode a runtime binary runs in: `.cdi` / `.legacy` force it (cmd/nvidia-container-
    runtime.{cdi,legacy}/main.go: WithModeOverride), else the toolkit config's."""
    if binary.endswith(".cdi"):
        return "cdi"
    if binary.endswith(".legacy"):
        return "legacy"
    return tk.mode if tk is not None else "auto"
