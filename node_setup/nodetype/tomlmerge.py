"""containerd's config files as containerd merges them: TOML parsing, `imports`, the 1.x and 2.x
merge rules, and 2.x's migration of older files.  Pure but for `load_files`, which reads the
files through a `Root`."""

from __future__ import annotations

import copy
import os
from typing import Any

from node_setup.nodetype.root import DetectError, Root

try:
    import tomllib

    TOMLError: type[Exception] = tomllib.TOMLDecodeError

    def loads(text: str) -> dict[str, Any]:
        return tomllib.loads(text)

except ImportError:  # Python 3.10: tomlkit (a dependency of the installer already)
    import tomlkit
    import tomlkit.exceptions

    TOMLError = tomlkit.exceptions.TOMLKitError

    def loads(text: str) -> dict[str, Any]:
        return tomlkit.parse(text).unwrap()


V1_CRI = "cri"
V2_CRI = "io.containerd.grpc.v1.cri"
V3_RUNTIME = "io.containerd.cri.v1.runtime"
CONFIG_VERSIONS = (1, 2, 3, 4)  # 4: containerd >= 2.3 (version/version.go: ConfigVersion)


def parse(text: str, where: str) -> dict[str, Any]:
    try:
        return loads(text)
    except TOMLError as e:
        raise DetectError(f"cannot parse {where}: {e}") from None


def get_path(d: Any, *keys: str) -> Any:
    """d[k1][k2]... or None where a level is missing or not a table."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def as_dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def cri_plugin_name(config_version: int) -> str:
    return {1: V1_CRI, 3: V3_RUNTIME, 4: V3_RUNTIME}.get(config_version, V2_CRI)


# containerd 2.x migrates every file older than its config version before merging it
# (cmd/containerd/server/config/config.go@v2.3.4: LoadConfigWithPlugins, MigrateConfigTo): version
# 1 plugin names become URIs (v1MigratePluginName), and the CRI runtime plugin takes what it
# owns from a version 2 `io.containerd.grpc.v1.cri` section (plugins/cri/runtime/plugin.go:
# configMigration, migrateConfig) - so a toolkit's version 2 drop-in is merged into 2.x's
# `io.containerd.cri.v1.runtime` (recorded: containerd2/merge/dump.main+version2-syntax-dropin.toml).
_V1_PLUGIN_NAMES = {"cri": V2_CRI}
_NOT_RUNTIME = {
    "cni", "containerd", "sandbox_image", "registry", "image_decryption", "max_concurrent_downloads",
    "image_pull_progress_timeout", "image_pull_with_sync_fs", "stats_collect_period", "disable_tcp_service",
    "stream_server_address", "stream_server_port", "stream_idle_timeout", "enable_tls_streaming",
    "x509_key_pair_streaming",
}  # fmt: skip
_NOT_RUNTIME_CTD = {"snapshotter", "disable_snapshot_annotations", "discard_unpacked_layers"}


def migrate_to_v3(doc: dict[str, Any]) -> dict[str, Any]:
    """A parsed config file of version 1 or 2 as containerd 2.x merges it (a copy)."""
    doc = copy.deepcopy(doc)
    version = doc.get("version", 1)
    plugins = doc.get("plugins")
    if not isinstance(plugins, dict) or not isinstance(version, int) or version >= 3:
        return doc
    if version <= 1:
        plugins = {_V1_PLUGIN_NAMES.get(k, k): v for k, v in plugins.items()}
        doc["plugins"] = plugins
    src = plugins.get(V2_CRI)
    if not isinstance(src, dict):
        return doc
    dst = plugins.get(V3_RUNTIME)
    if not isinstance(dst, dict):
        dst = plugins[V3_RUNTIME] = {}
    for k, v in src.items():
        if k not in _NOT_RUNTIME and k not in dst:
            dst[k] = copy.deepcopy(v)
    cni = src.get("cni")
    if isinstance(cni, dict):
        new_cni = dst.setdefault("cni", {})
        for k, v in cni.items():
            if k == "bin_dir":
                if not new_cni.get("bin_dirs"):
                    new_cni["bin_dirs"] = [v]
            elif k not in new_cni:
                new_cni[k] = copy.deepcopy(v)
    ctd = src.get("containerd")
    if isinstance(ctd, dict):
        new_ctd = dst.setdefault("containerd", {})
        for k, v in ctd.items():
            if k not in _NOT_RUNTIME_CTD and k not in new_ctd:
                new_ctd[k] = copy.deepcopy(v)
    return doc


def deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            deep_merge(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def import_patterns(doc: dict[str, Any], host_path: str, relative_to_cwd: bool = False) -> list[str]:
    """Absolute import patterns.  A relative one is joined to the importing file's directory
    (services/server/config/config.go@v1.7.34 and cmd/containerd/server/config/config.go@v2.3.4:
    resolveImports), except on containerd <= 1.6, which globs it from the process's working
    directory - `/` for the daemon (recorded: containerd2/contrast-containerd-1.6.20/
    dump.relative-glob-from-cwd-slash.toml imports nothing)."""
    imports = doc.get("imports") or []
    if not isinstance(imports, list):
        return []
    out = []
    for p in imports:
        if isinstance(p, str) and p:
            base = "/" if relative_to_cwd else os.path.dirname(host_path)
            out.append(os.path.normpath(p if p.startswith("/") else os.path.join(base, p)))
    return out


def read_tree(root: Root, conf: str, relative_to_cwd: bool = False) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The main file, then each `imports` pattern in order (globs sorted), recursively, each
    file once: (files in merge order, {file: parsed}).  A missing main file counts as empty."""
    order: list[str] = []
    parsed: dict[str, dict[str, Any]] = {}

    def visit(path: str) -> None:
        if path in parsed:
            return
        text = root.read(path)
        if text is None:
            if path == conf:
                parsed[path] = {}
                order.append(path)
            return
        doc = parse(text, path)
        parsed[path] = doc
        order.append(path)
        for pattern in import_patterns(doc, path, relative_to_cwd):
            for p in root.glob(pattern) if any(c in pattern for c in "*?[") else [pattern]:
                visit(p)

    visit(conf)
    return order, parsed


def merge(order: list[str], parsed: dict[str, dict[str, Any]], major: int) -> dict[str, Any]:
    """The effective config of these files with containerd's merge rules.

    containerd 1.x (`mergeConfig`): top-level keys of a later file win, and `plugins` entries
    are replaced *per plugin key* - a drop-in that names the CRI plugin replaces the whole CRI
    section of earlier files (containerd #5837).  2.x merges plugin tables deeply (containerd
    PR #9982, in v2.0.0), each file migrated first (migrate_to_v3)."""
    eff: dict[str, Any] = {}
    for path in order:
        doc = copy.deepcopy(parsed[path])
        doc.pop("imports", None)
        if major >= 2:
            deep_merge(eff, migrate_to_v3(doc))
            continue
        plugins = doc.pop("plugins", None)
        deep_merge(eff, doc)  # mergo.Merge(WithOverride) for the rest of the struct
        if isinstance(plugins, dict):
            eff.setdefault("plugins", {}).update(plugins)
    if order:
        eff["version"] = parsed[order[0]].get("version", 1)
    return eff


def load_files(
    root: Root, conf: str, major: int, relative_to_cwd: bool = False
) -> tuple[dict[str, Any], list[str], dict[str, dict[str, Any]]]:
    """Effective config from the files alone (read_tree, then merge):
    (effective, files in merge order, {file: parsed})."""
    order, parsed = read_tree(root, conf, relative_to_cwd)
    return merge(order, parsed, major), order, parsed
