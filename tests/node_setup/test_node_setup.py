"""vgpu-node-setup run FROM THE IMAGE (chroot into its unpacked layers, the host root bind-mounted
at /host, as the chart's privileged init container has it) against a debootstrap'd Debian 12 host
root that has containerd and Debian's python3 and nothing of ours:

- install puts libvgpu.so (versioned file behind a symlink), the hook tree and the launcher under
  /usr/local/vgpu with the right modes, and wires containerd's config through `vgpu-hook
  containerd install --root` with host paths only;
- a second install changes nothing; uninstall restores the host byte for byte;
- the installed hook runs in that root with only Debian's python3 (no msgspec, no venv): every
  module it copied imports, poststop and a token prestart run to their own decisions;
- the host's own containerd (chrooted into the host root) loads its CRI plugin from the
  installed config, both from Debian's shipped config.toml and from `containerd config default`;
- a host without python3 gets one line naming the alternatives and a non-zero exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim.procs import terminate
from tests.packaging import pkgbuild
from tests.support import imagebuild
from tests.support.imagebuild import default_config

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot, bind mounts and debootstrap need root"),
    pytest.mark.timeout(900),
]

SCOPE = ("etc", "usr/local", "var/lib", "var/log", "opt", "usr/lib/vgpu")
PREFIX = "/usr/local/vgpu"


@pytest.fixture(scope="module")
def image_root(image: dict[str, Any]) -> Path:
    root = imagebuild.rootfs(image)
    (root / "host").mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def debian() -> Path:
    return pkgbuild.debian_root()


@pytest.fixture
def debian_host(debian: Path) -> Iterator[Path]:
    """The root as debootstrap left it (Debian's shipped /etc/containerd/config.toml)."""
    with pkgbuild.scratch_root(debian) as root:
        yield root


@pytest.fixture
def host(debian_host: Path) -> Path:
    """... with the containerd config most nodes have: `containerd config default` (kubeadm's setup
    instructions, the toolkit's and the GPU Operator's edits start from it)."""
    (debian_host / "etc/containerd/config.toml").write_text(default_config(debian_host))
    return debian_host


def in_image(image_root: Path, host: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a command of the image with `host` at /host (private mount namespace, as a container)."""
    cmd = " ".join(shlex.quote(a) for a in args)
    script = (
        f"set -e; mount --rbind {shlex.quote(str(host))} {image_root}/host; "
        f"mount -t proc proc {image_root}/proc; mount --rbind /dev {image_root}/dev; "
        f"exec chroot {image_root} env -i PATH=/opt/vgpu/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 {cmd}"
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """path -> (mode, content hash or link target) for the parts of the host the installer may touch."""
    out: dict[str, tuple[int, str]] = {}
    for top in SCOPE:
        base = root / top
        if not base.exists():
            continue
        for p in [base, *sorted(base.rglob("*"))]:
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = "-> " + os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                data = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                data = ""
            out[str(p.relative_to(root))] = (st.st_mode, data)
    return out


def changed(a: dict[str, tuple[int, str]], b: dict[str, tuple[int, str]]) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def install(image_root: Path, host: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ("vgpu-node-setup", "install", "--host-root=/host", "--without-nvidia-runtime", *extra)
    return in_image(image_root, host, *args)


def test_install_second_install_and_uninstall(image_root: Path, host: Path) -> None:
    before = snapshot(host)
    r = install(image_root, host)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "hook runs with the host's /usr/bin/python3 (Python 3.11)" in r.stdout
    p = host / PREFIX.lstrip("/")
    man = json.loads((p / "node-setup.json").read_text())
    lib = p / "lib/libvgpu.so"
    assert os.readlink(lib) == man["library"] and (p / "lib" / man["library"]).is_file()
    assert stat.S_IMODE((p / "lib" / man["library"]).stat().st_mode) == 0o644
    assert (p / "lib" / man["library"]).read_bytes() == (image_root / "usr/lib/vgpu/libvgpu.so").read_bytes()
    assert os.readlink(p / "hook/current") == man["hook"]
    launcher = p / "bin/vgpu-hook"
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o755
    assert launcher.read_text().splitlines()[-1] == (
        f'exec /usr/bin/python3 -I -S {PREFIX}/hook/current/runtime_hook/fastpath.py "$@"'
    )
    hook_files = sorted(str(f.relative_to(p / "hook/current")) for f in (p / "hook/current").rglob("*.py"))
    assert "runtime_hook/fastpath.py" in hook_files and "vgpu/paths.py" in hook_files
    assert not [f for f in hook_files if f.startswith("node_setup/")]  # the installer: not stdlib-only
    assert "vgpu/config.py" not in hook_files
    for f in (p / "hook/current").rglob("*"):
        assert stat.S_IMODE(f.stat().st_mode) == (0o755 if f.is_dir() else 0o644), f
    # containerd's config: the vgpu handler with host paths only (nothing of /host or the image).
    conf = (host / "etc/containerd/config.toml").read_text()
    assert '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.vgpu]' in conf
    assert 'base_runtime_spec = "/etc/containerd/vgpu-base-spec.json"' in conf
    spec = json.loads((host / "etc/containerd/vgpu-base-spec.json").read_text())
    [pre] = [h for h in spec["hooks"]["prestart"] if any("fastpath.py" in a for a in h["args"])]
    args = pre["args"]
    assert f"{PREFIX}/hook/current/runtime_hook/fastpath.py" in args and "/usr/bin/python3" in args
    assert args[args.index("--library-path") + 1] == f"{PREFIX}/lib/libvgpu.so"
    assert not [a for a in args if "/host" in a or "/opt/vgpu" in a]
    installed = snapshot(host)
    assert changed(before, installed) and all(
        k.startswith(("usr/local", "etc/containerd")) for k in changed(before, installed)
    )

    r = install(image_root, host)
    assert r.returncode == 0, r.stderr
    assert f"{PREFIX} on the host: unchanged" in r.stdout
    assert changed(installed, snapshot(host)) == []

    st = in_image(image_root, host, "vgpu-node-setup", "status", "--host-root=/host", "--json")
    assert st.returncode == 0 and json.loads(st.stdout)["problems"] == []

    r = in_image(image_root, host, "vgpu-node-setup", "uninstall", "--host-root=/host")
    assert r.returncode == 0, r.stderr
    assert changed(before, snapshot(host)) == []
    st = in_image(image_root, host, "vgpu-node-setup", "status", "--host-root=/host")
    assert st.returncode == 1 and "installed: False" in st.stdout


def test_upgrade_swaps_the_library_and_keeps_the_mapped_inode(image_root: Path, host: Path) -> None:
    assert install(image_root, host).returncode == 0
    p = host / PREFIX.lstrip("/")
    old = (p / "lib/libvgpu.so").resolve()
    held = os.open(old, os.O_RDONLY)  # a container that mapped the library
    try:
        ino = os.fstat(held).st_ino
        newlib = host / "tmp/libvgpu-next.so"
        newlib.write_bytes(old.read_bytes() + b"\0next version")
        r = install(image_root, host, "--library-source=/host/tmp/libvgpu-next.so")
        assert r.returncode == 0, r.stderr
        new = (p / "lib/libvgpu.so").resolve()
        assert new != old and new.read_bytes().endswith(b"\0next version")
        assert old.exists() and old.stat().st_ino == ino  # the previous version stays for hooks in flight
        assert os.fstat(held).st_ino == ino and os.pread(held, 4, 0) == b"\x7fELF"
        man = json.loads((p / "node-setup.json").read_text())
        assert man["library_previous"] == old.name
    finally:
        os.close(held)
    assert in_image(image_root, host, "vgpu-node-setup", "uninstall", "--host-root=/host").returncode == 0
    assert not p.exists()


def test_installed_hook_runs_with_only_debian_python(image_root: Path, host: Path) -> None:
    assert install(image_root, host).returncode == 0
    # The root has Debian's python3 and none of the venv's packages.
    r = pkgbuild.chroot(host, "python3", "-c", "import msgspec", check=False)
    assert r.returncode != 0 and "No module named 'msgspec'" in r.stdout
    cur = f"{PREFIX}/hook/current"
    mods = sorted(
        str(f.relative_to(host / cur.lstrip("/")).with_suffix("")).replace("/", ".").removesuffix(".__init__")
        for f in (host / cur.lstrip("/")).rglob("*.py")
    )
    code = (
        f"import sys; sys.path.insert(0, {cur!r}); "
        + "; ".join(f"import {m}" for m in mods)
        + "; std = sys.stdlib_module_names"
        + "; print(sorted(n for n in sys.modules if n.split('.')[0] not in std and n != '__main__'))"
    )
    r = pkgbuild.chroot(host, "python3", "-I", "-S", "-c", code)
    ours = eval(r.stdout.strip().splitlines()[-1])
    assert set(ours) == set(mods), r.stdout  # nothing but our copied modules and the standard library
    state = host / "tmp/state"
    state.mkdir()
    # poststop of an unknown container: exit 0, silent.
    r = subprocess.run(
        ["chroot", str(host), f"{PREFIX}/bin/vgpu-hook", "--state-dir", "/tmp/state", "poststop"],
        input='{"ociVersion":"1.0.2","id":"abc","status":"stopped","bundle":"/nonexistent"}',
        capture_output=True,
        text=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert (r.returncode, r.stderr) == (0, "")
    # prestart of a container with a token that no allocation names: the full hook path runs
    # (site, cli, flag config, prestart) and refuses with one line, no ImportError.
    bundle = host / "tmp/bundle"
    bundle.mkdir()
    token = "0123456789abcdef0123456789abcdef"
    cfg = {"ociVersion": "1.0.2", "process": {"env": [f"VGPU_ALLOCATION_TOKEN={token}"]}, "root": {"path": "rootfs"}}
    (bundle / "config.json").write_text(json.dumps(cfg))
    flags = ["--state-dir", "/tmp/state", "--library-path", f"{PREFIX}/lib/libvgpu.so", "--log-dir", "/tmp/log",
             "--log-level", "warning", "--log-max-bytes", "100000"]  # fmt: skip
    r = subprocess.run(
        ["chroot", str(host), f"{PREFIX}/bin/vgpu-hook", *flags, "prestart"],
        input=json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 1, "bundle": "/tmp/bundle"}),
        capture_output=True,
        text=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("vgpu-hook: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Error" not in r.stderr.split(":")[1] and "No module" not in r.stderr


def test_host_without_python_gets_one_line(image_root: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        host = Path(d)
        (host / "etc/containerd").mkdir(parents=True)
        (host / "etc/containerd/config.toml").write_text("version = 2\n")
        r = install(image_root, host)
        assert r.returncode == 1
        [line] = r.stderr.strip().splitlines()
        assert "no python3 >= 3.9 on the host" in line and "Bottlerocket" in line and "--python" in line
        assert not (host / "usr/local/vgpu").exists()


def cri_plugin_status(host: Path) -> str:
    """Start the host's containerd on its own config inside the host root and return the CRI
    plugin's status line of `ctr plugins ls` ("ok" or "error").

    The mount namespace is private but the PID namespace is the machine's: the containerd started
    here is stopped by the PID recorded when it was started (`$!`), never by name - on a GPU node
    killing by name would hit the node's own containerd too."""
    script = f"""
set -e
mount -t proc proc {host}/proc; mount -t tmpfs tmpfs {host}/run; mount --rbind /dev {host}/dev
chroot {host} sh -c 'containerd --config /etc/containerd/config.toml >/tmp/containerd.log 2>&1 &
  pid=$!
  for i in $(seq 100); do
    [ -S /run/containerd/containerd.sock ] && ctr version >/dev/null 2>&1 && break; sleep 0.1
  done
  ctr plugins ls | grep -E "io.containerd.grpc.v1 +cri " || echo "cri missing"
  kill $pid 2>/dev/null || true
  for i in $(seq 50); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  kill -9 $pid 2>/dev/null || true; wait $pid 2>/dev/null || true'
"""
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "no output: " + r.stderr[-500:]
    return line.split()[-1] if line.startswith("io.containerd.grpc.v1") else line


def test_stopping_the_test_containerd_spares_every_other_containerd(host: Path, tmp_path: Path) -> None:
    """Another process called containerd (the node's own, on a GPU node) outlives the check."""
    decoy = tmp_path / "containerd"
    shutil.copy2(shutil.which("sleep") or "/bin/sleep", decoy)
    other = subprocess.Popen([str(decoy), "120"])
    try:
        assert cri_plugin_status(host) == "ok"
        assert other.poll() is None, "the test signalled a containerd it did not start"
    finally:
        terminate(other, 5)


def test_host_containerd_loads_the_installed_config_from_its_default(image_root: Path, host: Path) -> None:
    """A node whose config is `containerd config default` (explicit runc handler)."""
    assert cri_plugin_status(host) == "ok"
    r = install(image_root, host)
    assert r.returncode == 0, r.stderr
    assert cri_plugin_status(host) == "ok", (host / "tmp/containerd.log").read_text()[-2000:]


def test_host_containerd_loads_the_installed_config_from_debians(image_root: Path, debian_host: Path) -> None:
    """A node with Debian's shipped /etc/containerd/config.toml (no runtimes section)."""
    host = debian_host
    original = (host / "etc/containerd/config.toml").read_bytes()
    assert b"runtimes" not in original
    assert cri_plugin_status(host) == "ok"
    r = install(image_root, host)
    assert r.returncode == 0, r.stderr
    assert cri_plugin_status(host) == "ok", (host / "tmp/containerd.log").read_text()[-2000:]


def test_installer_never_leaves_a_config_that_breaks_cri(image_root: Path, debian_host: Path) -> None:
    """Whatever the containerd step writes, the node keeps a loadable CRI plugin: the installer
    checks the new config with the host's `containerd config dump` and, when the default runtime
    is gone, restores the old one and refuses with one line saying what to do."""
    host = debian_host
    original = (host / "etc/containerd/config.toml").read_bytes()
    r = install(image_root, host)
    if r.returncode == 0:  # node_setup.containerd keeps the implicit runc handler
        assert cri_plugin_status(host) == "ok"
        return
    [line] = r.stderr.strip().splitlines()
    assert "has no runtime `runc`" in line and "containerd config default" in line, line
    assert (host / "etc/containerd/config.toml").read_bytes() == original
    assert not (host / "etc/containerd/config.toml.vgpu-hook.json").exists()
    assert cri_plugin_status(host) == "ok"
