"""The node's containerd binary: where it is, its version, and the effective config it prints
(`containerd --config <file> config dump`, chrooted under --root)."""

from __future__ import annotations

from typing import Any

from node_setup.nodetype.root import Root
from node_setup.nodetype.tomlmerge import TOMLError, loads


def find_binary(root: Root, explicit: str | None) -> str:
    if explicit:
        return explicit if root.exists(explicit) else ""
    for cand in ("/usr/bin/containerd", "/usr/local/bin/containerd", "/bin/containerd"):
        if root.exists(cand):
            return cand
    return ""


def containerd_version(root: Root, exe: str) -> str:
    """`containerd --version` of the host binary ("" when unknown)."""
    if not exe:
        return ""
    r = root.run(exe, "--version")
    if r is None or r.returncode != 0:
        return ""
    return version_of(r.stdout)


def version_of(output: str) -> str:
    """The version in `containerd --version` output, without Debian's suffixes ("" when none).
    "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3" / "... v2.0.0 <sha>"."""
    for word in output.split()[2:3] or output.split():
        w = word.lstrip("v")
        if w[:1].isdigit():
            return w.split("~")[0].split("-")[0].split("+")[0]
    return ""


def config_dump(root: Root, exe: str, conf: str) -> tuple[dict[str, Any] | None, str]:
    """`containerd --config <conf> config dump` (chrooted when needed), or (None, why)."""
    if not exe:
        return None, "no containerd binary"
    r = root.run(exe, "--config", conf, "config", "dump")
    if r is None:
        return None, f"could not run {exe}"
    if r.returncode != 0:
        return None, f"`containerd config dump` failed: {r.stderr.strip()[-300:]}"
    try:
        return loads(r.stdout), ""
    except TOMLError as e:
        return None, f"`containerd config dump` printed unparsable TOML: {e}"
