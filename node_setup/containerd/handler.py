"""The vgpu handler's table, decided from the node facts (pure): which handler it copies and
which runtime binary it runs (node types: docs/operators/install.md), the annotations CRI must pass,
the handlers a 1.x file must keep explicit, and which file install edits on 1.x."""

from __future__ import annotations

import json
from typing import Any

from node_setup.hostfiles import InstallError
from node_setup.nodetype.facts import NodeFacts
from node_setup.nodetype.toolkit import runtime_mode

ANNOTATION_GLOB = "vgpu.k8s.io/*"

NO_NVIDIA = (
    "no NVIDIA container runtime found in {where}: the vgpu handler would start containers "
    "without any GPU. Install the NVIDIA Container Toolkit and run "
    "`nvidia-ctk runtime configure --runtime=containerd` (or deploy the GPU Operator), then "
    "re-run this command; or name the runtime with --nvidia-runtime PATH; or pass "
    "--without-nvidia-runtime where the GPU reaches containers another way (simulator, tests)"
)


class Choice:
    """What the vgpu handler is built from, and why."""

    def __init__(self, table: dict[str, Any], source: str, binary: str, notes: list[str]) -> None:
        self.table = table
        self.source = source  # handler copied ("" = none)
        self.binary = binary  # BinaryName of the vgpu handler ("" = runc on PATH)
        self.notes = notes


def choose_handler(facts: NodeFacts, nvidia_runtime: str | None, without: bool) -> Choice:
    """The table the vgpu handler starts from (a deep copy; ours is added by `vgpu_table`)."""
    notes: list[str] = []
    nv = facts.handler(facts.nvidia_handler) if facts.nvidia_handler else None
    runc = facts.handler("runc")
    if nvidia_runtime:
        base = nv or runc
        table = json.loads(json.dumps(base.table)) if base else {}
        table.setdefault("runtime_type", "io.containerd.runc.v2")
        table.setdefault("options", {})["BinaryName"] = nvidia_runtime
        return Choice(table, base.name if base else "", nvidia_runtime, ["--nvidia-runtime given"])
    if nv is not None:
        table = json.loads(json.dumps(nv.table))
        table.setdefault("runtime_type", "io.containerd.runc.v2")
        binary = nv.binary_name
        tk = facts.toolkit
        if runtime_mode(binary, tk) == "cdi":
            binary, note = cdi_mode_binary(facts, binary)
            table.setdefault("options", {})["BinaryName"] = binary
            notes.append(note)
        return Choice(table, nv.name, binary, notes)
    if not without:
        raise InstallError(NO_NVIDIA.format(where=", ".join(facts.files) or facts.containerd_config))
    opts = runc.table.get("options") if runc is not None else None
    table = {"runtime_type": "io.containerd.runc.v2", "options": json.loads(json.dumps(opts or {}))}
    return Choice(table, "runc" if runc else "", "", ["--without-nvidia-runtime: containers get no GPU from us"])


def uuid_named_kinds(facts: NodeFacts) -> set[str]:
    """Kinds of the node's CDI specs that name GPUs by UUID (`nvidia-ctk cdi generate` names each
    GPU by index and by UUID; the installer's management spec has only `all`)."""
    return {c.kind for c in facts.cdi_specs if any(d.startswith(("GPU-", "MIG-")) for d in c.devices)}


def cdi_mode_binary(facts: NodeFacts, binary: str) -> tuple[str, str]:
    """The BinaryName for a handler whose NVIDIA runtime runs in cdi mode, and why.

    In cdi mode the device plugin's NVIDIA_VISIBLE_DEVICES=<uuid> becomes `<default-kind>=<uuid>`
    (modifier/cdi.go@v1.20.0: cdiDeviceRequestor), which resolves only where a CDI spec of that
    kind names the GPUs by UUID.  The `.legacy` sibling is the same runtime with the mode forced
    to legacy, but its prestart hook reads the same config and refuses a container unless the
    mode resolves to legacy or `skip-mode-detection = true` (hook_config.go: assertModeIsLegacy),
    which only the GPU Operator's installer sets - a host toolkit's `nvidia-ctk config default`
    leaves it false.  So `.legacy` only where its hook accepts; else the runtime stays in cdi
    mode and the GPUs must be named so the CDI path finds them (our hook stays: the runtime
    removes only NVIDIA's own prestart hooks, modifier/hook_remover.go)."""
    tk = facts.toolkit
    kind = tk.default_kind if tk is not None else "nvidia.com/gpu"
    if facts.legacy_binary and tk is not None and tk.legacy_hook_accepts():
        return facts.legacy_binary, (
            f"NVIDIA runtime in cdi mode: using its legacy-mode sibling {facts.legacy_binary} "
            f"(its hook accepts: skip-mode-detection = true in {tk.path})"
        )
    why = (
        f"{facts.legacy_binary} is not used: its hook refuses in cdi mode (skip-mode-detection = false in "
        f"{tk.path if tk else 'the toolkit config'}); "
        if facts.legacy_binary
        else "no .legacy runtime; "
    )
    if kind in uuid_named_kinds(facts):
        how = (
            f"the device plugin's envvar strategy works (NVIDIA_VISIBLE_DEVICES=<uuid> becomes {kind}=<uuid>, "
            f"which a CDI spec defines), as do cdi-annotations and cdi-cri with kind {kind}"
        )
    else:
        how = (
            f"no CDI spec of kind {kind} names GPUs by UUID, so NVIDIA_VISIBLE_DEVICES=<uuid> cannot resolve: "
            f"generate one (nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml) or run the device plugin "
            f'with device_list_strategy = ["cdi-annotations"] (or cdi-cri) and cdi_kind naming a kind whose '
            f"spec has the GPUs by UUID"
        )
    return binary, f"NVIDIA runtime in cdi mode, kept ({why}{how})"


def vgpu_table(choice: Choice, base_spec: str, facts: NodeFacts) -> dict[str, Any]:
    """The copied table plus our base_runtime_spec and container_annotations."""
    table = json.loads(json.dumps(choice.table))
    table["base_runtime_spec"] = base_spec
    # CRI passes container annotations into the OCI spec only for the keys a runtime lists:
    # our token, and the CDI annotation prefixes the NVIDIA runtime reads in cdi mode.
    ann = [a for a in table.get("container_annotations") or [] if isinstance(a, str)]
    wanted = [ANNOTATION_GLOB]
    if choice.binary and facts.toolkit is not None:
        wanted += [p + "*" for p in facts.toolkit.annotation_prefixes]
    for a in wanted:
        if a not in ann:
            ann.append(a)
    table["container_annotations"] = ann
    return table


def implicit_handlers(facts: NodeFacts, handler: str) -> dict[str, dict[str, Any]]:
    """The handlers a 1.x config file gets from containerd's built-in defaults only.

    containerd 1.x decodes `runtimes` as a whole map: a file that defines any runtime replaces
    the built-in map, i.e. the implicit `runc` (Debian's shipped config.toml has no runtimes
    section).  Adding ours alone would leave the default runtime undefined and the CRI plugin
    would refuse to load ("no corresponding runtime configured in containerd.runtimes for
    default_runtime_name"), so such a file gets explicit copies of what the effective config had
    (from `config dump`), or containerd's default runc table where no dump was possible.
    """
    out = {h.name: json.loads(json.dumps(h.table)) for h in facts.handlers if h.name != handler and h.table}
    if not out:
        out["runc"] = {"runtime_type": "io.containerd.runc.v2"}
    return out


def target_v2(facts: NodeFacts) -> str:
    """The file install edits on containerd 1.x: the one whose CRI section containerd uses.

    On 1.x `imports` replace plugin sections per key: a drop-in that names the CRI plugin
    (the toolkit >= 1.18 writes conf.d/99-nvidia.toml with a copy of the whole CRI section)
    replaces the main file's CRI section entirely, so a handler added to the main file is
    silently lost.  We add ours inside that same drop-in's CRI section, next to the
    `nvidia` handler it copies, rather than in a later-sorting drop-in of our own carrying
    a second full copy: that copy would freeze the CRI section as it is today and shadow
    every later change to 99-nvidia.toml (a toolkit upgrade or `nvidia-ctk runtime
    configure` re-run), without any error.  The cost of our choice: re-running
    `nvidia-ctk runtime configure` regenerates the drop-in and drops `vgpu` - containerd then
    reports the missing handler at pod start, `vgpuctl doctor` FAILs, and re-running
    `vgpu-hook containerd install` puts it back.  The same rule holds on 1.6 and 1.7
    (`mergeConfig` in services/server/config/config.go); the test proves it with 1.6's
    `containerd config dump`.
    """
    return facts.cri_file or facts.containerd_config
