"""A repository rule, checked: tests never signal processes by name.

`make test` may run on a real GPU node, and most suites share the machine's PID namespace even
when they unshare mounts: a kill by name (`pid` + `of`, `p` + `kill`, `kill` + `all`) reaches the
node's own containerd, kubelet or device plugin. Tests signal only the PIDs they started
(`subprocess.Popen.pid`, `$!` in shell). The names are spelled in pieces here so that this file
does not trip its own check.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = re.compile(r"\b(" + "|".join(("pid" + "of", "p" + "kill", "kill" + "all")) + r")\b")
# Recorded traces are data written by real programs, not code that runs.
SKIP = (ROOT / "tests" / "data",)


def _sources() -> list[Path]:
    out = [ROOT / "Makefile"]
    for p in sorted((ROOT / "tests").rglob("*")):
        if not p.is_file() or p.is_symlink() or any(p.is_relative_to(s) for s in SKIP):
            continue
        if "__pycache__" in p.parts:
            continue
        out.append(p)
    return out


def test_no_test_signals_processes_by_name() -> None:
    hits = []
    for p in _sources():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if BY_NAME.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "tests must signal only the PIDs they started, never by name:\n" + "\n".join(hits)


def test_the_check_sees_a_kill_by_name() -> None:
    assert BY_NAME.search("  kill $(" + "pid" + "of containerd) 2>/dev/null")
    assert BY_NAME.search("p" + "kill -f vgpu-device-plugin")
    assert not BY_NAME.search("kill $pid; os.kill(proc.pid, signal.SIGTERM)")
