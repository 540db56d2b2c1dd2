"""The edits install and uninstall make to containerd's config files (text in, text out, with
tomlkit: comments and every other setting kept): config version 2 (containerd 1.x) edited in
place, version 3 (2.x) given a drop-in and an `imports` entry."""

from __future__ import annotations

from typing import Any

import tomlkit
from tomlkit.items import Table

from node_setup.hookspec import MARK
from node_setup.hostfiles import InstallError
from node_setup.nodetype.tomlmerge import V2_CRI, V3_RUNTIME


def to_toml(table: dict[str, Any], comment: str | None = None) -> Any:
    t = tomlkit.table()
    if comment:
        t.add(tomlkit.comment(comment))
    for k, v in table.items():  # plain keys first, sub-tables after (tomlkit orders the output)
        t[k] = to_toml(v) if isinstance(v, dict) else v
    return t


# ---- config editing -----------------------------------------------------------


def _table(parent: Any, key: str) -> Any:
    if key not in parent:
        parent[key] = tomlkit.table()
    return parent[key]


def _runtimes_v2(doc: Any) -> Any:
    cri = _table(_table(doc, "plugins"), V2_CRI)
    return _table(cri, "containerd")


def edit_v2(
    text: str,
    handler: str,
    table: dict[str, Any],
    make_default: bool,
    implicit: dict[str, dict[str, Any]] | None = None,
) -> str:
    """containerd 1.x config (version 2): set runtimes.<handler>, optionally the default.

    `implicit`: handlers to write explicitly when the file has no runtimes table yet
    (`implicit_handlers`)."""
    doc = tomlkit.parse(text)
    if doc.get("version", 1) not in (2,):
        raise InstallError(f"containerd 1.x config version {doc.get('version', 1)} unsupported (need version = 2)")
    ctd = _runtimes_v2(doc)
    had_runtimes = "runtimes" in ctd
    runtimes = _table(ctd, "runtimes")
    if not had_runtimes:
        for name, t in (implicit or {}).items():
            runtimes[name] = to_toml(t, f"added by {MARK}: containerd's built-in handler, kept explicit")
    runtimes[handler] = to_toml(table, f"added by {MARK}: OCI hooks for vGPU containers")
    if make_default:
        ctd["default_runtime_name"] = handler
    return tomlkit.dumps(doc)


def remove_v2(text: str, handler: str, previous_default: str | None) -> str:
    doc = tomlkit.parse(text)
    try:
        ctd = doc["plugins"][V2_CRI]["containerd"]  # type: ignore[index]
    except KeyError:
        return text
    runtimes = ctd.get("runtimes")
    if isinstance(runtimes, Table) and handler in runtimes:
        del runtimes[handler]
    if ctd.get("default_runtime_name") == handler:
        ctd["default_runtime_name"] = previous_default or "runc"
    return tomlkit.dumps(doc)


def dropin_v3(handler: str, table: dict[str, Any], make_default: bool) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"written by {MARK}; removed by `vgpu-hook containerd uninstall`"))
    doc["version"] = 3
    rt_parent = tomlkit.table(is_super_table=True)
    ctd = tomlkit.table(is_super_table=not make_default)
    if make_default:
        ctd["default_runtime_name"] = handler
    rts = tomlkit.table(is_super_table=True)
    rts[handler] = to_toml(table)
    ctd["runtimes"] = rts
    rt_parent["containerd"] = ctd
    plugins = tomlkit.table(is_super_table=True)
    plugins[V3_RUNTIME] = rt_parent
    doc["plugins"] = plugins
    return tomlkit.dumps(doc)


def ensure_import(text: str, pattern: str) -> str:
    doc = tomlkit.parse(text)
    if doc.get("version", 1) not in (3, 4):
        raise InstallError("containerd 2.x needs config `version = 3` or 4 (run `containerd config migrate`)")
    imports = doc.get("imports")
    if imports is None:
        arr = tomlkit.array()
        arr.append(pattern)
        doc["imports"] = arr  # tomlkit places a plain key before the first table
    elif pattern not in list(imports):
        imports.append(pattern)
    return tomlkit.dumps(doc)
