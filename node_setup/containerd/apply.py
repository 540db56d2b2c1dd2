"""`containerd install | uninstall | print | detect` carried out: the node detected, the host's
files read (HostTree, the plan's Host), the plan written with backups and the sidecar, or the
originals restored.  Each returns the lines the command prints."""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
from typing import Any

from node_setup import hostfiles
from node_setup.containerd.plan import (
    Options,
    Plan,
    backup_path,
    parse_sidecar,
    plan_install,
    plan_uninstall,
    sidecar_path,
)
from node_setup.hostfiles import InstallError
from node_setup.nodetype import report
from node_setup.nodetype.detect import detect as detect_node
from node_setup.nodetype.facts import NodeFacts
from node_setup.nodetype.root import DetectError, Root


class HostTree:
    """The host tree under --root, as planning asks of it (plan.Host)."""

    def __init__(self, root: Root) -> None:
        self.root = root

    @property
    def is_host(self) -> bool:
        return self.root.is_host

    @property
    def where(self) -> str:
        return self.root.root

    def read(self, path: str) -> str | None:
        return hostfiles.read(self.root, path)

    def exists(self, path: str) -> bool:
        return self.root.exists(path)

    def default_spec(self, source: str | None) -> dict[str, Any]:
        """The spec to add our hooks to: `source` (a file here), else `ctr oci spec` (the host's under --root)."""
        if source:
            try:
                with open(source, "rb") as f:
                    spec = json.load(f)
            except (OSError, ValueError) as e:
                raise InstallError(f"cannot read base spec {source}: {e}") from None
        else:
            spec = json.loads(self._ctr_oci_spec())
        if not isinstance(spec, dict):
            raise InstallError("base spec is not a JSON object")
        return spec

    def _ctr_oci_spec(self) -> str:
        argv: list[str] | None = None
        if self.root.is_host:
            ctr = shutil.which("ctr")
            argv = [ctr, "oci", "spec"] if ctr else None
        else:
            for cand in ("/usr/bin/ctr", "/usr/local/bin/ctr", "/bin/ctr"):
                if self.root.exists(cand):
                    argv = self.root.command(cand, "oci", "spec")
                    break
        if argv is None:
            raise InstallError("`ctr` not found: pass --base-spec-source with containerd's default spec")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise InstallError(f"`ctr oci spec` failed: {r.stderr.strip()[:200]}")
        return r.stdout

    def default_config(self, containerd_bin: str) -> str:
        """`containerd config default` of the host's binary, else a bare version 2 file."""
        if containerd_bin:
            r = self.root.run(containerd_bin, "config", "default")
            if r is not None and r.returncode == 0 and r.stdout.strip():
                return r.stdout
        return "version = 2\n"


def detect(opts: Options) -> NodeFacts:
    try:
        return detect_node(
            opts.containerd_config,
            root=opts.root,
            containerd_bin=opts.containerd_bin,
            toolkit_config=opts.toolkit_config,
            major=opts.major,
            exclude=opts.handler,
        )
    except DetectError as e:
        raise InstallError(str(e)) from None


def planned(opts: Options) -> tuple[Root, Plan]:
    root = Root(opts.root)
    return root, plan_install(opts, detect(opts), HostTree(root))


def install(opts: Options) -> list[str]:
    """Backups of the originals (once), the sidecar, then every file that changes."""
    root, plan = planned(opts)
    state = plan.state
    for path, rec in state["files"].items():
        bak = backup_path(path)
        if rec.get("original") is not None and hostfiles.read(root, bak) is None:
            hostfiles.write(root, bak, rec["original"], 0o600)
    hostfiles.write(root, sidecar_path(opts.containerd_config), json.dumps(state, indent=2) + "\n", 0o600)
    for path, text in plan.files.items():
        if plan.old.get(path) != text:
            hostfiles.write(root, path, text)
    via = f" -> {state['binary']}" if state["binary"] else " -> runc (no NVIDIA runtime)"
    return [f"vgpu-hook: {n}" for n in plan.notes] + [
        f"vgpu-hook: containerd {state['major']}.x configured (handler `{opts.handler}`{via}, "
        f"node type {state['node_type']}); restart containerd"
    ]


def uninstall(opts: Options) -> list[str]:
    root = Root(opts.root)
    side = sidecar_path(opts.containerd_config)
    state = parse_sidecar(side, hostfiles.read(root, side))
    if state is None:
        return ["vgpu-hook: nothing to uninstall"]
    restore = plan_uninstall(state, HostTree(root))
    for path, text in restore.write.items():
        hostfiles.write(root, path, text)
    for path in [*restore.remove, side]:
        hostfiles.unlink(root, path)
    return ["vgpu-hook: containerd configuration restored; restart containerd"]


def show(opts: Options) -> str:
    """What install would do: the node's facts and decisions as comments, then a diff per file."""
    _, plan = planned(opts)
    lines = [f"# {line}\n" for line in report.summary(plan.facts)]
    c = plan.choice
    src = f"a copy of handler `{c.source}`" if c.source else "a new table"
    lines.append(f"# handler `{opts.handler}`: {src}, BinaryName {c.binary or '(runc on PATH)'}\n")
    lines += [f"# {n}\n" for n in plan.notes]
    for path in sorted(plan.files, key=lambda p: p.endswith(".json")):  # the configs first, the base spec last
        text = plan.files[path]
        old = plan.old.get(path)
        if old == text:
            lines.append(f"# {path}: unchanged\n")
            continue
        lines += difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=path if old is not None else "/dev/null",
            tofile=path,
        )
    return "".join(lines)


def describe(opts: Options, as_json: bool) -> str:
    facts = detect(opts)
    return report.to_json(facts) if as_json else "\n".join(report.summary(facts)) + "\n"
