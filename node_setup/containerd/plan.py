"""What `containerd install` would write and `uninstall` would restore, as data: given the node
facts, the options and what the host's files hold (asked of a `Host`), no file is written here
and nothing is run but through the Host (apply.HostTree reads the real tree)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import tomlkit

from node_setup.containerd.handler import Choice, choose_handler, implicit_handlers, target_v2, vgpu_table
from node_setup.containerd.spec import with_hooks, without_default_security
from node_setup.containerd.tomledit import dropin_v3, edit_v2, ensure_import, remove_v2
from node_setup.hookspec import MARK, HookOptions, missing_on_host
from node_setup.hostfiles import InstallError
from node_setup.nodetype import report
from node_setup.nodetype.facts import NodeFacts
from node_setup.nodetype.tomlmerge import V2_CRI


class Host(Protocol):
    """What planning asks of the host tree."""

    @property
    def is_host(self) -> bool: ...  # the tree is this machine's `/` (no --root)

    @property
    def where(self) -> str: ...  # the --root directory, for messages

    def read(self, path: str) -> str | None: ...  # a host file's text, None when absent

    def exists(self, path: str) -> bool: ...

    def default_spec(self, source: str | None) -> dict[str, Any]: ...  # `source` or `ctr oci spec`

    def default_config(self, containerd_bin: str) -> str: ...  # `containerd config default`


@dataclass(frozen=True)
class Options:
    """`vgpu-hook containerd ...` (node_setup.hookcmd turns the flags into these)."""

    containerd_config: str  # host path of the main config, absolute
    root: str = "/"  # the host's / (every file is read and written under it)
    major: int | None = None  # containerd's major version (None: detected)
    containerd_bin: str | None = None  # for `config dump` (None: found)
    toolkit_config: str | None = None  # the NVIDIA runtime's config.toml (None: detected)
    handler: str = "vgpu"  # runtime handler name (RuntimeClass.handler)
    make_default: bool = False  # also make the handler containerd's default runtime
    base_spec: str = ""  # host path of the base runtime spec, absolute ("" = beside the config)
    base_spec_source: str | None = None  # a file to start from instead of `ctr oci spec`
    conf_d: str = ""  # containerd 2.x drop-in directory, absolute ("" = <config dir>/conf.d)
    nvidia_runtime: str | None = None  # BinaryName for the vgpu handler (overrides detection)
    without_nvidia_runtime: bool = False  # allow a node without NVIDIA runtime (simulator, tests)
    hook: HookOptions | None = None  # the hook's command (install and print)

    @property
    def base_spec_path(self) -> str:
        return self.base_spec or os.path.join(os.path.dirname(self.containerd_config), "vgpu-base-spec.json")

    @property
    def conf_d_path(self) -> str:
        return self.conf_d or os.path.join(os.path.dirname(self.containerd_config), "conf.d")


@dataclass
class Plan:
    """What install would write: {host path: new text} (and what each holds now), the node facts,
    what it decided, and the sidecar it records (`state`: what uninstall needs)."""

    facts: NodeFacts
    choice: Choice
    files: dict[str, str] = field(default_factory=dict)
    old: dict[str, str | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Restore:
    """What uninstall does: files to write back, files to remove (the sidecar last)."""

    write: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)


def sidecar_path(conf: str) -> str:
    return conf + f".{MARK}.json"


def backup_path(path: str) -> str:
    return path + f".{MARK}.bak"


def sha(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8", "surrogateescape")).hexdigest()


def parse_sidecar(path: str, text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        d = json.loads(text)
    except ValueError:
        raise InstallError(f"{path} is corrupt; remove it to start over") from None
    return d if isinstance(d, dict) else None


def files_of(state: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{config file: {"original", "installed_sha256"}} of a sidecar (also the older one-file form)."""
    if not state:
        return {}
    files = state.get("files")
    if isinstance(files, dict):
        return {k: v for k, v in files.items() if isinstance(v, dict)}
    if "config" in state:
        return {state["config"]: {"original": state.get("original"), "installed_sha256": state.get("installed_sha256")}}
    return {}


def plan_install(opts: Options, facts: NodeFacts, host: Host) -> Plan:
    """The files install writes and the sidecar it records (InstallError: it must not)."""
    if opts.hook is None:
        raise ValueError("install needs the hook's options")
    if not host.is_host:
        missing = missing_on_host(opts.hook, host.exists, host.where)
        if missing:
            raise InstallError(missing)
    if facts.cri_error and not opts.make_default:
        # Nothing we add makes the CRI plugin load (only --default, naming our handler, would):
        # saying "configured" would leave a node whose kubelet cannot start any pod.
        raise InstallError(
            f"containerd's CRI plugin will not load with this configuration: {facts.cri_error}. "
            f"{report.cri_fix(facts)}; then re-run this command"
        )
    choice = choose_handler(facts, opts.nvidia_runtime, opts.without_nvidia_runtime)
    base_spec = opts.base_spec_path
    spec = with_hooks(_start_spec(opts, choice, host), opts.hook.entries())
    table = vgpu_table(choice, base_spec, facts)
    plan = Plan(facts=facts, choice=choice, notes=list(choice.notes))
    plan.files[base_spec] = json.dumps(spec, indent=2) + "\n"
    plan.state = {
        "major": facts.containerd_major,
        "handler": opts.handler,
        "base_spec": base_spec,
        "config": opts.containerd_config,
        "node_type": facts.node_type,
        "copied_from": choice.source,
        "binary": choice.binary,
        "without_nvidia_runtime": opts.without_nvidia_runtime,
        "nvidia_runtime": opts.nvidia_runtime or "",
    }
    side = sidecar_path(opts.containerd_config)
    prev = parse_sidecar(side, host.read(side))
    if facts.containerd_major == 1:
        edited = _edit_cri_file(opts, plan, table, prev, host)
    else:
        edited = _add_dropin(opts, plan, table, host)
    for path in plan.files:
        plan.old[path] = host.read(path)
    plan.state["files"] = _file_records(plan, files_of(prev), edited, host)
    return plan


def _start_spec(opts: Options, choice: Choice, host: Host) -> dict[str, Any]:
    """The spec our hooks are added to: the copied handler's own base spec (its defaults are the
    admin's choice, its hooks kept), else containerd's default as CRI uses it."""
    theirs = str(choice.table.get("base_runtime_spec") or "")
    if not opts.base_spec_source and theirs and theirs != opts.base_spec_path:
        text = host.read(theirs)
        if text is not None:
            try:
                start = json.loads(text)
            except ValueError:
                raise InstallError(f"base_runtime_spec {theirs} of handler `{choice.source}` is not JSON") from None
            if isinstance(start, dict):
                return start
    return without_default_security(host.default_spec(opts.base_spec_source))


def _edit_cri_file(
    opts: Options, plan: Plan, table: dict[str, Any], prev: dict[str, Any] | None, host: Host
) -> list[str]:
    """containerd 1.x: our handler in the file that owns the CRI section; the files edited."""
    facts = plan.facts
    target = target_v2(facts)
    text = host.read(target)
    start = text if text is not None else host.default_config(facts.containerd_bin)
    rec = files_of(prev).get(target)
    if rec and text is not None and sha(text) == rec.get("installed_sha256"):
        # Unchanged since our last install: start again from what was there before it, so
        # a re-install is byte-identical (tomlkit lays out an edited table differently).
        orig = rec.get("original")
        start = orig if isinstance(orig, str) else host.default_config(facts.containerd_bin)
    try:
        ctd = tomlkit.parse(start).get("plugins", {}).get(V2_CRI, {}).get("containerd", {})
    except Exception as e:
        raise InstallError(f"cannot parse {target}: {e}") from None
    prev_default = prev.get("previous_default") if prev else ctd.get("default_runtime_name")
    if prev_default == opts.handler:
        prev_default = "runc"
    implicit = implicit_handlers(facts, opts.handler)
    plan.files[target] = edit_v2(start, opts.handler, table, opts.make_default, implicit)
    plan.state["previous_default"] = prev_default
    plan.state["target"] = target
    if target != opts.containerd_config:
        plan.notes.append(
            f"containerd 1.x: {target} owns the CRI section (it replaces the main file's): the handler goes there"
        )
    return [target]


def _add_dropin(opts: Options, plan: Plan, table: dict[str, Any], host: Host) -> list[str]:
    """containerd 2.x: our drop-in, and the main config importing the drop-in directory."""
    conf = opts.containerd_config
    dropin = os.path.join(opts.conf_d_path, "vgpu.toml")
    plan.files[dropin] = dropin_v3(opts.handler, table, opts.make_default)
    plan.state["dropin"] = dropin
    text = host.read(conf)
    plan.files[conf] = ensure_import(
        text if text is not None else "version = 3\n", os.path.join(opts.conf_d_path, "*.toml")
    )
    return [conf]


def _file_records(
    plan: Plan, prev_files: dict[str, dict[str, Any]], edited: list[str], host: Host
) -> dict[str, dict[str, Any]]:
    """Each config file install has ever edited: its original text (kept from the first install)
    and the digest of what install writes now."""
    files = {}
    for path in set(prev_files) | set(edited):
        rec = dict(prev_files.get(path) or {"original": plan.old[path] if path in plan.old else host.read(path)})
        if path in plan.files:
            rec["installed_sha256"] = sha(plan.files[path])
        files[path] = rec
    return files


def plan_uninstall(state: dict[str, Any], host: Host) -> Restore:
    """Each edited file back to its original (byte for byte while nobody changed it since;
    else only our keys removed, on 1.x), our files and backups removed."""
    out = Restore()
    for path, rec in files_of(state).items():
        current = host.read(path)
        original = rec.get("original")
        if sha(current) == rec.get("installed_sha256") or current == original:
            if original is None:
                out.remove.append(path)
            else:
                out.write[path] = original
        elif current is not None and state.get("major") == 1:
            out.write[path] = remove_v2(current, state.get("handler", "vgpu"), state.get("previous_default"))
        # (2.x: an edited main config keeps its harmless `imports` entry.)
        out.remove.append(backup_path(path))
    for ours in (state.get("dropin"), state.get("base_spec")):
        if isinstance(ours, str) and ours:
            out.remove.append(ours)
    return out
