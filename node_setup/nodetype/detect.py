"""`detect()`: everything install and doctor need to know about this node, read under a `Root`
(the containerd binary and config files, `containerd config dump`, the NVIDIA toolkit's config
and version, the CDI specs) and decided by `classify`."""

from __future__ import annotations

import os
from typing import Any

from node_setup.nodetype import classify, dump
from node_setup.nodetype.cdi import read_cdi_specs
from node_setup.nodetype.facts import DEFAULT_CDI_DIRS, NodeFacts, version_tuple
from node_setup.nodetype.root import DetectError, Root
from node_setup.nodetype.tomlmerge import (
    CONFIG_VERSIONS,
    V3_RUNTIME,
    as_dict,
    cri_plugin_name,
    get_path,
    load_files,
    parse,
)
from node_setup.nodetype.toolkit import read_toolkit, toolkit_config_path, toolkit_version


def detect(
    containerd_config: str = "/etc/containerd/config.toml",
    *,
    root: str = "/",
    containerd_bin: str | None = None,
    toolkit_config: str | None = None,
    major: int | None = None,
    use_dump: bool = True,
    exclude: str = "vgpu",
) -> NodeFacts:
    """Everything install and doctor need to know about this node (see the package doc).

    `major`: containerd's major version when known (else from the config version and
    `containerd --version`); `use_dump`: ask `containerd config dump` for the effective config
    (else the files are merged here); `exclude`: our own handler, never the one copied."""
    r = Root(root)
    conf = os.path.abspath(containerd_config) if containerd_config.startswith("/") else containerd_config
    facts = NodeFacts(root=r.root, containerd_config=conf)
    facts.config_exists = r.exists(conf)
    facts.containerd_bin = dump.find_binary(r, containerd_bin)
    facts.containerd_version = dump.containerd_version(r, facts.containerd_bin)
    facts.config_version = config_version(r, conf)
    facts.containerd_major = major if major is not None else guess_major(facts.config_version, facts.containerd_version)
    # 2.x migrates older files: its CRI runtime plugin is io.containerd.cri.v1.runtime either way
    facts.cri_plugin = V3_RUNTIME if facts.containerd_major >= 2 else cri_plugin_name(facts.config_version)
    eff, files_eff, parsed = _effective_config(r, facts, use_dump)
    _cri_facts(r, facts, eff, files_eff, parsed)
    _nvidia_facts(r, facts, toolkit_config, exclude, parsed)
    return facts


def config_version(root: Root, conf: str) -> int:
    """The main file's `version` (2 when the file is absent or empty); DetectError when unsupported."""
    text = root.read(conf)
    version = parse(text, conf).get("version", 1) if text else 2
    if not isinstance(version, int) or isinstance(version, bool) or version not in CONFIG_VERSIONS:
        raise DetectError(f"{conf}: unsupported config version {version!r} (expected 1, 2, 3 or 4)")
    return version


def guess_major(config_version: int, containerd_version: str) -> int:
    """containerd's major version: 2 for a version 3+ config, else the binary's, else 1."""
    if config_version >= 3:
        return 2
    if containerd_version:
        return 2 if containerd_version.startswith("2") else 1
    return 1


def _effective_config(
    r: Root, facts: NodeFacts, use_dump: bool
) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """(effective config, the files' merge, {file: parsed}): from `containerd config dump` when
    it can tell (facts.source says which, facts.source_note why not), else the files' merge."""
    major = facts.containerd_major
    ver = version_tuple(facts.containerd_version)
    old = major == 1 and bool(ver) and ver[:2] <= (1, 6)  # unknown 1.x: resolved as 1.7 does
    files_eff, order, parsed = load_files(r, facts.containerd_config, major, relative_to_cwd=old)
    facts.files = order
    eff: dict[str, Any] | None = None
    v = facts.containerd_version
    bin_major = int(v[0]) if v[:1].isdigit() else None
    if use_dump and facts.config_exists and bin_major is not None and bin_major != major:
        facts.source_note = f"containerd {v} is not the {major}.x this config is for"
    elif use_dump and facts.config_exists:
        eff, why = dump.config_dump(r, facts.containerd_bin, facts.containerd_config)
        if eff is not None:
            facts.source = "config dump"
        else:
            facts.source_note = why
    elif not facts.config_exists:
        facts.source_note = f"{facts.containerd_config} does not exist"
    return (files_eff if eff is None else eff), files_eff, parsed


def _cri_facts(
    r: Root, facts: NodeFacts, eff: dict[str, Any], files_eff: dict[str, Any], parsed: dict[str, dict[str, Any]]
) -> None:
    """The CRI section's facts: which file owns it, the default runtime and whether the plugin
    loads, the handlers, CDI."""
    cri = facts.cri_plugin
    # 1.x: the last file in merge order that has the CRI plugin owns the whole section.
    for path in reversed(facts.files):
        if isinstance(get_path(parsed[path], "plugins", cri), dict):
            facts.cri_file = path
            break
    cri_sec = as_dict(get_path(eff, "plugins", cri))
    ctd = as_dict(cri_sec.get("containerd"))
    raw_ctd = get_path(files_eff, "plugins", cri, "containerd")
    facts.default_runtime = str(ctd.get("default_runtime_name") or "runc")
    if facts.config_exists:
        facts.cri_error = classify.cri_load_error(facts.containerd_major, ctd)
    facts.handlers = classify.handlers_of(ctd, raw_ctd if isinstance(raw_ctd, dict) else None, r.exists)
    facts.cdi_enabled = bool(cri_sec.get("enable_cdi", facts.containerd_major >= 2))
    file_cri = get_path(files_eff, "plugins", cri)
    if facts.source == "config dump" and isinstance(file_cri, dict) and "enable_cdi" in file_cri:
        if "enable_cdi" not in cri_sec:
            facts.notes.append(
                f"containerd {facts.containerd_version or facts.containerd_major} ignores enable_cdi "
                f"(CDI in containerd needs >= 1.7)"
            )
    dirs = cri_sec.get("cdi_spec_dirs")
    facts.cdi_spec_dirs = [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else list(DEFAULT_CDI_DIRS)


def _nvidia_facts(
    r: Root, facts: NodeFacts, toolkit_config: str | None, exclude: str, parsed: dict[str, dict[str, Any]]
) -> None:
    """The NVIDIA handler install copies, the toolkit config it reads, the node type, the CDI specs."""
    nv = classify.pick_nvidia(facts.handlers, facts.default_runtime, exclude)
    # The specs that can reach a container: containerd's directories where its CDI is on (a
    # containerd without CDI - every 1.6 - never reads them), the NVIDIA runtime's in any case.
    spec_dirs = list(facts.cdi_spec_dirs) if facts.cdi_enabled else []
    if nv is not None:
        facts.nvidia_handler = nv.name
        legacy = classify.legacy_sibling(nv.binary_name)
        if legacy and r.exists(legacy):
            facts.legacy_binary = legacy
        tk = read_toolkit(r, toolkit_config or toolkit_config_path(r, nv.binary_name))
        facts.toolkit = tk
        facts.toolkit_version = toolkit_version(r, nv.binary_name)
        spec_dirs += [d for d in tk.spec_dirs if d not in spec_dirs]
        if not nv.binary_exists:
            facts.notes.append(f"handler `{nv.name}`: BinaryName {nv.binary_name or '(none)'} does not exist")
        facts.node_type = classify.node_type(nv, tk, facts.toolkit_version, parsed)
    elif toolkit_config:
        facts.toolkit = read_toolkit(r, toolkit_config)
    facts.cdi_specs = read_cdi_specs(r, spec_dirs)
