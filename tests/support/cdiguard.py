"""Runs pytest on a node whose CDI directories hold NVIDIA's spec, and reports what changed there.

Meant to run in a mount namespace of its own (`unshare --mount --propagation private -- python
-m tests.support.cdiguard OUTER-NS SPEC -- PYTEST-ARGS...`, tests/repo/test_hermetic_cdi.py): /etc/cdi and
/var/run/cdi become fresh tmpfs mounts holding SPEC - what `nvidia-ctk cdi generate` leaves on a
GPU node - so every process of the run (containerd, podman, runc, the plugins) sees them as on
such a node, while the host's own directories are never touched.  Prints one JSON line: pytest's
exit status, the tail of its output, and the two directories' contents before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

DIRS = ("/etc/cdi", "/var/run/cdi")


def contents() -> dict[str, str]:
    """path -> sha256 (or `-> target` for a link, `dir` for a directory) of everything in DIRS."""
    out: dict[str, str] = {}
    for top in DIRS:
        for d, dirs, files in os.walk(top):
            for name in dirs:
                out[os.path.join(d, name)] = "dir"
            for name in files:
                p = os.path.join(d, name)
                if os.path.islink(p):
                    out[p] = "-> " + os.readlink(p)
                else:
                    with open(p, "rb") as f:
                        out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def main(argv: list[str]) -> int:
    outer, spec, sep, pytest_args = argv[0], argv[1], argv[2], argv[3:]
    if sep != "--":
        sys.stderr.write("usage: cdiguard OUTER-NS SPEC -- PYTEST-ARGS...\n")
        return 2
    # OUTER-NS: the caller's mount namespace (readlink /proc/self/ns/mnt): ours must be another
    # one, or the mounts below would stay on the caller's system.
    if os.readlink("/proc/self/ns/mnt") == outer:
        sys.stderr.write("cdiguard: not in a mount namespace of its own (run it under unshare --mount)\n")
        return 2
    for d in DIRS:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "cdiguard", d], check=True)
        shutil.copy(spec, os.path.join(d, os.path.basename(spec)))
    before = contents()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    after = contents()
    tail = (r.stdout + r.stderr)[-6000:]
    print(json.dumps({"rc": r.returncode, "tail": tail, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
