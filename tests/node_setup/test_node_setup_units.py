"""vgpu-node-setup without the image: the hook's import audit, host python3 detection in a host
root, atomic placement, the uninstall Job's wait; install and uninstall against a plain host root
(the containerd step for real): what a containerd config directory may hold (sockets, FIFOs,
files that cannot be read), and uninstall after an interrupted install."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from node_setup import files, hookfiles, hostpython, setup, waitds
from tests.support import traces

ROOT = Path(__file__).resolve().parents[2]


def test_hook_closure_is_stdlib_only_and_excludes_the_installer() -> None:
    rels = hookfiles.hook_files(ROOT)
    assert "runtime_hook/fastpath.py" in rels and "runtime_hook/prestart.py" in rels and "vgpu/paths.py" in rels
    assert not [r for r in rels if r.startswith(("device_plugin/", "monitor/", "node_setup/"))]
    assert "vgpu/config.py" not in rels
    assert {"vgpu/schemas.py", "vgpu/region.py", "vgpu/limits.py", "vgpu/statedir.py"} <= set(rels)


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
    assert files.write_if_changed(f, b"x", 0o644) and not files.write_if_changed(f, b"x", 0o644)
    assert files.write_if_changed(f, b"x", 0o755) and (f.stat().st_mode & 0o777) == 0o755
    link = tmp_path / "l"
    assert files.symlink_atomic(link, "a") and not files.symlink_atomic(link, "a")
    assert not [p for p in tmp_path.iterdir() if files.is_temporary(p.name)]
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


# --- install and uninstall against a host root (the containerd step runs for real) -------------


def _host(tmp: Path) -> Path:
    """A host root with containerd's default config (as 1.6.20 writes it) and a python3."""
    host = tmp / "host"
    (host / "etc/containerd").mkdir(parents=True)
    shutil.copy(
        traces.path("nvidia-toolkit/bases/containerd-1.6.20-config-default.toml"), host / "etc/containerd/config.toml"
    )
    _python(host, "python3.11", "python3.11")
    return host


def _opts(tmp: Path, host: Path, *, base_spec: bool = True) -> setup.Options:
    lib = tmp / "libvgpu.so"
    lib.write_bytes(b"\x7fELF not really")
    args = ["--containerd-version", "1"]
    if base_spec:  # the host root has no `ctr` to ask for containerd's default spec
        args += ["--base-spec-source", str(traces.path("containerd-cri/ctr-oci-spec.containerd-1.6.20.json"))]
    return setup.Options(
        host_root=str(host), library_source=str(lib), without_nvidia_runtime=True, containerd_args=args
    )


def _entries(root: Path) -> dict[str, tuple[int, str]]:
    """path -> (mode, content hash or link target) of every entry, never opening non-regular files."""
    out: dict[str, tuple[int, str]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = ""
        if stat.S_ISLNK(st.st_mode):
            data = os.readlink(p)
        elif stat.S_ISREG(st.st_mode):
            data = hashlib.sha256(p.read_bytes()).hexdigest()
        out[str(p.relative_to(root))] = (st.st_mode, data)
    return out


def test_sockets_and_fifos_in_containerd_config_dir_are_skipped_with_a_note(tmp_path: Path) -> None:
    host = _host(tmp_path)
    (host / "etc/containerd/run").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(host / "etc/containerd/run/debug.sock"))
    sock.listen()
    os.mkfifo(host / "etc/containerd/pipe")  # opening it for reading would block the installer
    before = _entries(host)
    opts = _opts(tmp_path, host)
    try:
        lines = setup.install(opts)
        assert "vgpu-node-setup: note: skipped /etc/containerd/pipe: a FIFO, not a regular file" in lines
        assert "vgpu-node-setup: note: skipped /etc/containerd/run/debug.sock: a socket, not a regular file" in lines
        assert (host / "usr/local/vgpu/node-setup.json").exists()
        assert setup.status(opts)[0] == 0
        lines = setup.uninstall(opts)
        assert "vgpu-node-setup: note: skipped /etc/containerd/pipe: a FIFO, not a regular file" in lines
    finally:
        sock.close()
    assert _entries(host) == before


def test_unreadable_special_file_in_containerd_config_dir(tmp_path: Path) -> None:
    """A file of a special filesystem mounted into the config dir: stat says regular, read()
    fails with EINVAL. The installer compares it by size and time, says so, and goes on."""
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    host = _host(tmp_path)
    special = host / "etc/containerd/special"
    special.touch()
    opts = _opts(tmp_path, host)
    code = (
        "import json, sys; from node_setup import setup; o = setup.Options(**json.loads(sys.argv[1])); "
        "print(json.dumps([setup.install(o), setup.uninstall(o)]))"
    )
    argv = [sys.executable, "-c", code, json.dumps(msgspec.to_builtins(opts))]
    script = f"mount --bind /proc/1/clear_refs {shlex.quote(str(special))} && exec {shlex.join(argv)}"
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    installed, removed = json.loads(r.stdout)
    note = (
        "vgpu-node-setup: note: cannot read /etc/containerd/special (Invalid argument): compared by size and time only"
    )
    assert note in installed and note in removed
    assert not (host / "usr/local/vgpu").exists()


def test_uninstall_after_an_interrupted_install_leaves_nothing(tmp_path: Path) -> None:
    """The containerd step fails after the library and the hook were placed (here: no `ctr` on the
    host to ask for containerd's default spec). uninstall still removes every file and every
    directory that install created: the host is as it was."""
    host = _host(tmp_path)
    before = _entries(host)
    opts = _opts(tmp_path, host, base_spec=False)
    with pytest.raises(setup.SetupError, match="`ctr` not found"):
        setup.install(opts)
    assert (host / "usr/local/vgpu/lib").is_dir()
    code, report = setup.status(opts)
    assert code == 1 and "the last install did not finish: run install again (or uninstall)" in report["problems"]
    setup.uninstall(opts)
    assert _entries(host) == before


def test_uninstall_removes_what_an_install_killed_half_way_left(tmp_path: Path) -> None:
    """A kill between two writes leaves temporary files and a version the install had not pruned."""
    host = _host(tmp_path)
    before = _entries(host)
    opts = _opts(tmp_path, host)
    setup.install(opts)
    prefix = host / "usr/local/vgpu"
    (prefix / "lib" / ("libvgpu.so" + files.TMP_SUFFIX)).symlink_to("libvgpu-0123456789abcdef.so")
    (prefix / "lib/libvgpu-0123456789abcdef.so").write_bytes(b"older")
    (prefix / "hook" / ("fedcba9876543210" + files.TMP_SUFFIX) / "runtime_hook").mkdir(parents=True)
    (prefix / "bin" / ".tmp-vgpu-hook.4242.4242").write_text("#!/bin/sh\n")  # vgpu.schemas.write_atomic's
    setup.uninstall(opts)
    assert _entries(host) == before


# --- --library-only (DRA nodes) -----------------------------------------------------------------


def _library_only(tmp: Path, host: Path, data: bytes = b"\x7fELF not really") -> setup.Options:
    lib = tmp / "libvgpu.so"
    lib.write_bytes(data)
    return setup.Options(host_root=str(host), library_source=str(lib), library_only=True)


def test_library_only_places_the_library_alone_and_uninstall_restores_the_host(tmp_path: Path) -> None:
    """No host python3 needed, containerd's config untouched, the library under the prefix."""
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    shutil.copy(
        traces.path("nvidia-toolkit/bases/containerd-1.6.20-config-default.toml"), host / "etc/containerd/config.toml"
    )
    before = _entries(host)
    opts = _library_only(tmp_path, host)
    lines = setup.install(opts)
    assert "vgpu-node-setup: library only (DRA): no hook, containerd's configuration untouched" in lines
    prefix = host / "usr/local/vgpu"
    assert (prefix / "lib/libvgpu.so").read_bytes() == b"\x7fELF not really"
    added = set(_entries(host)) - set(before)
    name = os.readlink(prefix / "lib/libvgpu.so")
    assert added == {"usr", "usr/local", "usr/local/vgpu", "usr/local/vgpu/lib", "usr/local/vgpu/node-setup.json",
                     "usr/local/vgpu/lib/libvgpu.so", f"usr/local/vgpu/lib/{name}"}  # fmt: skip
    assert {k: v for k, v in _entries(host).items() if k in before} == before  # containerd's files as they were
    code, report = setup.status(opts)
    assert code == 0 and report["library_only"] is True and report["problems"] == []
    assert setup.install(opts)[0] == "vgpu-node-setup: /usr/local/vgpu on the host: unchanged"
    # a new library: swapped by link, the old one kept for processes that mapped it
    opts2 = _library_only(tmp_path, host, b"\x7fELF newer")
    setup.install(opts2)
    assert (prefix / "lib/libvgpu.so").read_bytes() == b"\x7fELF newer"
    assert (prefix / "lib" / name).exists()
    lines = setup.uninstall(setup.Options(host_root=str(host)))  # the manifest says library-only
    assert "vgpu-node-setup: removed /usr/local/vgpu from the host" in lines
    assert _entries(host) == before


def test_library_only_over_a_full_install_renews_the_library_and_uninstall_removes_all(tmp_path: Path) -> None:
    """A node that ran the device plugin, switched to DRA: the library is renewed, the hook and
    containerd's handler stay until uninstall, which removes them too."""
    host = _host(tmp_path)
    before = _entries(host)
    full = _opts(tmp_path, host)
    setup.install(full)
    prefix = host / "usr/local/vgpu"
    assert (prefix / "bin/vgpu-hook").exists()
    (tmp_path / "dra").mkdir()
    lines = setup.install(_library_only(tmp_path / "dra", host, b"\x7fELF for dra"))
    assert lines[-1].endswith(
        "the hook and containerd handler of an earlier full install stay (uninstall removes them)"
    )
    assert (prefix / "lib/libvgpu.so").read_bytes() == b"\x7fELF for dra"
    assert (prefix / "bin/vgpu-hook").exists() and setup.status(full)[0] == 0
    setup.uninstall(full)
    assert _entries(host) == before


def test_library_only_from_the_command_line(tmp_path: Path) -> None:
    from node_setup.__main__ import main

    host = tmp_path / "host"
    host.mkdir()
    lib = tmp_path / "libvgpu.so"
    lib.write_bytes(b"\x7fELF cli")
    args = ["--host-root", str(host), "--library-source", str(lib), "--library-only"]
    assert main(["install", *args]) == 0
    assert (host / "usr/local/vgpu/lib/libvgpu.so").read_bytes() == b"\x7fELF cli"
    assert main(["status", *args]) == 0
    assert main(["uninstall", *args]) == 0
    assert list(host.iterdir()) == []
