"""Container identity from /proc/<pid>/cgroup.

Handles cgroup v1 (one line per hierarchy) and v2 (`0::/path`), with the
cgroupfs and systemd drivers and the runtimes' naming:

    v1 cgroupfs (kubelet):  /kubepods/besteffort/pod<uid>/<id>
    v2 systemd (kubelet):   /kubepods.slice/kubepods-burstable.slice/
                            kubepods-burstable-pod<uid_with_underscores>.slice/
                            cri-containerd-<id>.scope
    docker / CRI-O / podman / nerdctl: docker-<id>.scope, crio-<id>.scope,
                            libpod-<id>.scope, nerdctl-<id>.scope, /docker/<id>
    containerd (ctr) cgroupfs: /<namespace>/<id>

`candidates()` returns every plausible container id, most specific first; the
caller keeps the first one that has a state directory.  The text is read from
/proc of a process that may be inside a container, but the kernel writes it:
a container can move itself only below its own cgroup (cgroup namespaces),
never out of it, so an id found here is trustworthy.
"""

from __future__ import annotations

import re

_SCOPE_PREFIXES = ("cri-containerd-", "containerd-", "docker-", "crio-", "libpod-", "nerdctl-", "cri-o-")
_POD_RE = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_ID_RE = re.compile(r"^[A-Za-z0-9_+.-]{1,128}$")


def paths(text: str) -> list[str]:
    """The cgroup paths of every hierarchy line (v2 line first)."""
    v2: list[str] = []
    v1: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if not path.startswith("/"):
            continue
        (v2 if hid == "0" and controllers == "" else v1).append(path)
    seen: set[str] = set()
    out = []
    for p in v2 + v1:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def component_id(comp: str) -> str:
    """A path component reduced to the id it names (`cri-containerd-<id>.scope` -> `<id>`)."""
    c = comp
    if c.endswith(".scope"):
        c = c[: -len(".scope")]
        for pre in _SCOPE_PREFIXES:
            if c.startswith(pre):
                return c[len(pre) :]
    return c


def candidates(text: str) -> list[str]:
    """Possible container ids in a /proc/<pid>/cgroup text, most specific (deepest) first."""
    out: list[str] = []
    seen: set[str] = set()
    for p in paths(text):
        comps = [c for c in p.split("/") if c]
        for comp in reversed(comps):
            if comp.endswith(".slice"):
                continue
            cid = component_id(comp)
            if cid and cid not in seen and _ID_RE.match(cid) and cid not in (".", ".."):
                seen.add(cid)
                out.append(cid)
    return out


def pod_uid(text: str) -> str:
    """The pod uid in a kubelet cgroup path ('' if none); systemd's underscores become dashes."""
    m = _POD_RE.search(text)
    return m.group(1).replace("_", "-").lower() if m else ""


def leaf_of_spec(cgroups_path: str) -> str:
    """The last component a runtime makes of an OCI `linux.cgroupsPath`.

    systemd form `slice:prefix:name` becomes `prefix-name.scope`; a plain path is
    its last component."""
    if cgroups_path.count(":") == 2 and not cgroups_path.startswith("/"):
        _slice, prefix, name = cgroups_path.split(":")
        return f"{prefix}-{name}.scope" if prefix else f"{name}.scope"
    comps = [c for c in cgroups_path.split("/") if c]
    return comps[-1] if comps else ""


def in_cgroup(text: str, cgroups_path: str) -> bool:
    """True when the process text's cgroups include the container's `cgroupsPath` (or lie below it)."""
    if not cgroups_path:
        return False
    if cgroups_path.startswith("/"):
        want = cgroups_path.rstrip("/")
        return any(p == want or p.startswith(want + "/") or p.endswith(want) or (want + "/") in p for p in paths(text))
    leaf = leaf_of_spec(cgroups_path)
    return bool(leaf) and any(leaf in p.split("/") for p in paths(text))
