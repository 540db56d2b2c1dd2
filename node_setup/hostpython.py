"""Find the host's python3 (>= 3.9) inside a host root, without running it.

The hook is started by runc on the host, so it needs an interpreter that lives on the host.
A path is resolved inside the root (nodetype.root.resolve_in_root: absolute symlink targets are
taken relative to it, so a `/usr/bin/python3 -> /usr/bin/python3.11` link in /host resolves to
/host/usr/bin/python3.11);
the version comes from the resolved name (`python3.N`), or, for an unversioned name, from
`pythonX.Y` in `lib/` next to it.
"""

from __future__ import annotations

import os
import re

from node_setup.nodetype.root import resolve_in_root

MIN_VERSION = (3, 9)
CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3")
ALTERNATIVES = (
    "install python3 >= 3.9 on the node (Debian 11+, Ubuntu 22.04+, RHEL/Rocky 9 have it), "
    "or pass --python PATH to a host interpreter, or run without the hook on this node "
    "(container-optimised OSes such as Bottlerocket, Flatcar or COS ship no python3)"
)
_VERSIONED = re.compile(r"^python(\d+)\.(\d+)$")


class NoHostPython(Exception):
    """The host root has no usable python3: the message names the alternatives."""


def version_of(root: str, host_path: str) -> tuple[int, int] | None:
    m = _VERSIONED.match(os.path.basename(host_path))
    if m:
        return int(m.group(1)), int(m.group(2))
    libdir = os.path.join(root, os.path.dirname(os.path.dirname(host_path)).lstrip("/"), "lib")
    try:
        names = os.listdir(libdir)
    except OSError:
        return None
    found = sorted(
        (int(m.group(1)), int(m.group(2)))
        for m in (_VERSIONED.match(n) for n in names)
        if m and os.path.exists(os.path.join(libdir, m.group(0), "os.py"))
    )
    return found[-1] if found else None


def find(root: str, explicit: str | None = None) -> tuple[str, tuple[int, int]]:
    """(host path to run, version); the path is the stable name (e.g. /usr/bin/python3), not its target."""
    for cand in (explicit,) if explicit else CANDIDATES:
        real = resolve_in_root(root, cand, must_exist=True)
        if real is None or not os.access(os.path.join(root, real.lstrip("/")), os.X_OK):
            continue
        ver = version_of(root, real)
        if ver is None:
            continue
        if ver < MIN_VERSION:
            raise NoHostPython(f"host {cand} is Python {ver[0]}.{ver[1]}, the vGPU hook needs >= 3.9: {ALTERNATIVES}")
        return cand, ver
    where = explicit or ", ".join(CANDIDATES)
    raise NoHostPython(f"no python3 >= 3.9 on the host (looked for {where} under {root}): {ALTERNATIVES}")
