"""What detection found, for people and programs: the human summary, the JSON form, and the
one-line fix for a CRI plugin that will not load."""

from __future__ import annotations

import msgspec

from node_setup.nodetype.facts import NodeFacts


def cri_fix(facts: NodeFacts) -> str:
    """What to do about `facts.cri_error` (one line)."""
    names = [h.name for h in facts.handlers]
    missing = facts.default_runtime
    if facts.containerd_major == 1 and facts.cri_file and facts.cri_file != facts.containerd_config:
        where = (
            f"{facts.cri_file} replaces the whole CRI section of the files before it on containerd 1.x and "
            f"defines only {', '.join(names) or 'no runtime'}"
        )
    else:
        where = f"the effective config defines only {', '.join(names) or 'no runtime'}"
    table = f'[plugins."{facts.cri_plugin}".containerd.runtimes.{missing}] runtime_type = "io.containerd.runc.v2"'
    return (
        f"{where}: add {table} to {facts.cri_file or facts.containerd_config} (or regenerate "
        f"{facts.containerd_config} with `containerd config default` and re-run `nvidia-ctk runtime configure "
        f"--runtime=containerd`), then restart containerd"
    )


def to_json(facts: NodeFacts) -> str:
    return msgspec.json.encode(facts).decode() + "\n"


def summary(facts: NodeFacts) -> list[str]:
    """Human lines: node type and the facts behind it."""
    lines = [f"node type: {facts.node_type}"]
    ver = facts.containerd_version or "unknown"
    lines.append(
        f"containerd {ver} (config version {facts.config_version}, CRI plugin {facts.cri_plugin}), "
        f"effective config from {facts.source}" + (f" ({facts.source_note})" if facts.source_note else "")
    )
    if facts.files:
        lines.append("config files in merge order: " + ", ".join(facts.files))
    if facts.cri_file and facts.containerd_major == 1:
        lines.append(f"CRI section owned by: {facts.cri_file}")
    lines.append(f"default runtime: {facts.default_runtime}")
    for h in facts.handlers:
        if h.nvidia or h.name == facts.default_runtime:
            miss = "" if h.binary_exists or not h.binary_name else " (missing)"
            lines.append(f"handler {h.name}: BinaryName={h.binary_name or '-'}{miss}")
    lines.extend(_toolkit_lines(facts))
    if facts.legacy_binary:
        lines.append(f"legacy-mode runtime: {facts.legacy_binary}")
    if facts.cri_error:
        lines.append(f"CRI plugin will NOT load: {facts.cri_error}")
    lines.append(
        f"CDI: {'enabled' if facts.cdi_enabled else 'disabled'} in containerd, "
        f"{len(facts.cdi_specs)} spec(s)"
        + "".join(f"; {s.path} ({s.kind}: {len(s.devices)} devices)" for s in facts.cdi_specs)
    )
    lines.extend(f"note: {n}" for n in facts.notes)
    return lines


def _toolkit_lines(facts: NodeFacts) -> list[str]:
    tk = facts.toolkit
    if tk is None:
        return []
    state = "" if tk.exists else " (absent: defaults)"
    lines = [
        f"toolkit config {tk.path}{state}: mode={tk.mode} default-kind={tk.default_kind} "
        f"accept-envvar-when-unprivileged={str(tk.accept_envvar_unprivileged).lower()} "
        f"accept-volume-mounts={str(tk.accept_volume_mounts).lower()} "
        f"annotation-prefixes={','.join(tk.annotation_prefixes)} spec-dirs={','.join(tk.spec_dirs)}"
    ]
    if tk.error:
        lines.append(f"toolkit config error: {tk.error}")
    if tk.skip_mode_detection:
        lines.append("toolkit config: nvidia-container-runtime-hook.skip-mode-detection = true")
    return lines
