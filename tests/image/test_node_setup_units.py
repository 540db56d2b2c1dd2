"""vgpu-node-setup's pure parts, without root: the hook's import audit, host python3 detection in
a host root, atomic placement, the uninstall Job's wait."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_setup import files, hookfiles, hostpython, setup, waitds

ROOT = Path(__file__).resolve().parents[2]


def test_hook_closure_is_stdlib_only_and_excludes_the_installer() -> None:
    rels = hookfiles.hook_files(ROOT)
    assert "runtime_hook/fastpath.py" in rels and "runtime_hook/prestart.py" in rels and "vgpu/paths.py" in rels
    assert not [r for r in rels if r.startswith(("device_plugin/", "monitor/", "node_setup/"))]
    assert not {"runtime_hook/containerd.py", "vgpu/config.py", "vgpu/schemas.py"} & set(rels)


def _tree(tmp: Path) -> Path:
    for pkg in ("runtime_hook", "vgpu"):
        shutil.copytree(ROOT / pkg, tmp / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


def test_audit_refuses_a_third_party_import_on_the_hook_path(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    p = root / "runtime_hook/poststop.py"
    p.write_text(p.read_text() + "\n\ndef _later() -> None:\n    import msgspec  # noqa\n")
    with pytest.raises(
        ValueError, match=r"runtime_hook\.poststop imports msgspec, which is not in the standard library"
    ):
        hookfiles.hook_files(root)


def test_audit_follows_new_modules_of_ours(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    (root / "vgpu/extra.py").write_text("import json\n")
    p = root / "runtime_hook/prestart.py"
    p.write_text(p.read_text() + "\nfrom vgpu import extra  # noqa\n")
    assert "vgpu/extra.py" in hookfiles.hook_files(root)


def _python(root: Path, name: str, link: str | None = None) -> None:
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    exe = root / "usr/bin" / name
    exe.write_text("#!/bin/false\n")
    exe.chmod(0o755)
    if link:
        os.symlink(link, root / "usr/bin/python3")


def test_host_python_found_through_absolute_links_inside_the_root(tmp_path: Path) -> None:
    _python(tmp_path, "python3.11", "/usr/bin/python3.11")  # absolute: must resolve inside the root
    assert hostpython.find(str(tmp_path)) == ("/usr/bin/python3", (3, 11))


def test_host_python_too_old_or_missing(tmp_path: Path) -> None:
    _python(tmp_path, "python3.6", "python3.6")
    with pytest.raises(hostpython.NoHostPython, match=r"Python 3\.6, the vGPU hook needs >= 3\.9"):
        hostpython.find(str(tmp_path))
    with pytest.raises(hostpython.NoHostPython, match=r"no python3 >= 3\.9 on the host") as e:
        hostpython.find(str(tmp_path / "empty"))
    assert "Bottlerocket" in str(e.value) and "--python" in str(e.value)


def test_atomic_placement_is_idempotent(tmp_path: Path) -> None:
    f = tmp_path / "a"
    assert files.write_atomic(f, b"x", 0o644) and not files.write_atomic(f, b"x", 0o644)
    assert files.write_atomic(f, b"x", 0o755) and (f.stat().st_mode & 0o777) == 0o755
    link = tmp_path / "l"
    assert files.symlink_atomic(link, "a") and not files.symlink_atomic(link, "a")
    assert not list(tmp_path.glob("*" + files.TMP_SUFFIX))
    with pytest.raises(FileExistsError):
        files.symlink_atomic(f, "b")  # a real file is never replaced by a link


def test_launcher_quotes_paths() -> None:
    text = setup.launcher_text("/opt/py thon/bin/python3", "/usr/local/vgpu")
    assert text.splitlines()[-1] == (
        "exec '/opt/py thon/bin/python3' -I -S /usr/local/vgpu/hook/current/runtime_hook/fastpath.py \"$@\""
    )


class _Api:
    def __init__(self, states: list[tuple[int, int, int]]) -> None:
        self.states = states
        self.calls = 0

    def read_namespaced_daemon_set(self, name: str, namespace: str) -> Any:
        d, r, u = self.states[min(self.calls, len(self.states) - 1)]
        self.calls += 1
        return SimpleNamespace(
            status=SimpleNamespace(desired_number_scheduled=d, number_ready=r, updated_number_scheduled=u)
        )


def test_wait_daemonset() -> None:
    api = _Api([(3, 0, 0), (3, 2, 3), (3, 3, 3)])
    assert waitds.wait("ns", "ds", timeout=10, interval=0, api=api) and api.calls == 3
    assert not waitds.wait("ns", "ds", timeout=0, interval=0, api=_Api([(2, 1, 2)]))


def test_restart_needs_systemd_on_the_host(tmp_path: Path) -> None:
    with pytest.raises(setup.SetupError, match="does not run systemd; restart containerd yourself"):
        setup.restart_containerd(setup.Options(host_root=str(tmp_path), restart_containerd=True))
