"""The deb and rpm, built for real with nfpm and checked with the distributions' own tools.

- the .deb installs with dpkg into a clean Debian root (debootstrap), its commands run there,
  the units are enabled, the state directory is root-only; reinstall keeps an edited conffile;
  remove disables the units and keeps state; purge removes state and the config;
- `systemd-analyze verify` accepts the units against that root;
- lintian reports no error; `rpm -qpl`/`-qpi` show the same file set as the .deb.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sim.procs import terminate
from tests.packaging import pkgbuild
from vgpu import __version__

pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="dpkg into a chroot and overlay mounts need root"),
    pytest.mark.timeout(900),
]

UNITS = ("vgpu-device-plugin.service", "vgpu-monitor.service")
COMMANDS = ("vgpu-hook", "vgpu-device-plugin", "vgpu-dra-plugin", "vgpu-monitor", "vgpuctl")


@dataclass
class Built:
    deb: Path
    rpm: Path
    base: Path  # the clean Debian root
    lint: subprocess.Popen[str]  # lintian on the .deb, running while the other tests do


@pytest.fixture(scope="module")
def built(build_dir: Path) -> Iterator[Built]:
    """The packages, the clean root and a lintian run: the slow parts, overlapped."""
    with ThreadPoolExecutor(1) as pool:
        base = pool.submit(pkgbuild.debian_root)  # downloads while the packages build
        pkgs = pkgbuild.build_packages()
        if shutil.which("lintian") is None:
            pytest.fail("lintian is not installed (apt-get install lintian; .ci/run does)")
        lint = subprocess.Popen(
            ["lintian", "--allow-root", "--tag-display-limit", "0", str(pkgs.deb)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            yield Built(pkgs.deb, pkgs.rpm, base.result(), lint)
        finally:
            if lint.poll() is None:
                lint.kill()
            lint.communicate()


@pytest.fixture(scope="module")
def packages(built: Built) -> pkgbuild.Packages:
    return pkgbuild.Packages(built.deb, built.rpm)


@pytest.fixture(scope="module")
def installed(built: Built) -> Iterator[Path]:
    """A scratch Debian root with the .deb installed by dpkg (module-wide: one install)."""
    with pkgbuild.scratch_root(built.base) as root:
        shutil.copy(built.deb, root / "tmp" / built.deb.name)
        r = pkgbuild.chroot(root, "dpkg", "-i", "/tmp/" + built.deb.name)
        root.joinpath("tmp", "dpkg-install.log").write_text(r.stdout)
        yield root


def test_package_metadata(packages: pkgbuild.Packages) -> None:
    info = subprocess.run(["dpkg-deb", "-f", str(packages.deb)], check=True, capture_output=True, text=True).stdout
    fields = dict(line.split(": ", 1) for line in info.splitlines() if ": " in line and not line.startswith(" "))
    assert fields["Package"] == "k8s-vgpu"
    assert fields["Version"] == f"{__version__}-1"
    assert "python3 (>= 3." in fields["Depends"] and "libc6" in fields["Depends"]
    conffiles = subprocess.run(
        ["dpkg-deb", "--ctrl-tarfile", str(packages.deb)], check=True, capture_output=True
    ).stdout
    assert b"./conffiles" in subprocess.run(["tar", "-t"], input=conffiles, capture_output=True).stdout


def test_deb_contents(packages: pkgbuild.Packages) -> None:
    files = pkgbuild.deb_files(packages.deb)
    for cmd in COMMANDS:
        assert files[f"/usr/bin/{cmd}"] == f"l -> /opt/vgpu/bin/{cmd}"
        assert files[f"/opt/vgpu/bin/{cmd}"] == "f"
    for path in (
        "/usr/lib/vgpu/libvgpu.so",
        "/etc/vgpu/config.toml",
        "/usr/lib/systemd/system/vgpu-device-plugin.service",
        "/usr/lib/systemd/system/vgpu-monitor.service",
        "/usr/lib/systemd/system/vgpu-dra-plugin.service",
        "/usr/share/vgpu/helm/k8s-vgpu/Chart.yaml",
        "/usr/share/vgpu/grafana/k8s-vgpu-dashboard.json",
        "/usr/share/vgpu/prometheus/k8s-vgpu-rules.yaml",
        "/usr/share/doc/k8s-vgpu/copyright",
        "/opt/vgpu/pyvenv.cfg",
    ):
        assert files.get(path) == "f", path
    manifests = sorted(p for p in files if p.startswith("/usr/share/vgpu/k8s/"))
    shipped = sorted(f"/usr/share/vgpu/k8s/{p.name}" for p in (pkgbuild.ROOT / "packaging/k8s").glob("*.yaml"))
    assert manifests == shipped and shipped
    # Nothing of the build machine leaks into the package.
    assert not [p for p in files if "/build/" in p or p.endswith(".egg-link") or "/pip/" in p]


def test_rpm_has_the_same_file_set(packages: pkgbuild.Packages) -> None:
    deb = pkgbuild.deb_files(packages.deb)
    rpm = pkgbuild.rpm_files(packages.rpm)
    assert sorted(set(deb) ^ set(rpm)) == []
    assert deb == rpm
    listed = subprocess.run(["rpm", "-qpl", str(packages.rpm)], check=True, capture_output=True, text=True).stdout
    assert set(deb) <= set(listed.split("\n"))
    info = subprocess.run(["rpm", "-qpi", str(packages.rpm)], check=True, capture_output=True, text=True).stdout
    assert "Name        : k8s-vgpu" in info
    assert f"Version     : {__version__}" in info
    config = subprocess.run(["rpm", "-qpc", str(packages.rpm)], check=True, capture_output=True, text=True).stdout
    assert config.split() == ["/etc/vgpu/config.toml"]
    scripts = subprocess.run(
        ["rpm", "-qp", "--scripts", str(packages.rpm)], check=True, capture_output=True, text=True
    ).stdout
    for phase in ("postinstall", "preuninstall", "postuninstall"):
        assert f"{phase} scriptlet" in scripts


def test_installs_into_a_clean_debian_root(installed: Path) -> None:
    root = installed
    log = root.joinpath("tmp", "dpkg-install.log").read_text()
    assert "vgpu-hook containerd install" in log  # the one command, printed, not run
    assert not root.joinpath("etc/containerd/config.toml.vgpu-hook.json").exists()
    assert not root.joinpath("etc/containerd/vgpu-base-spec.json").exists()
    for cmd in COMMANDS:
        assert os.readlink(root / "usr/bin" / cmd) == f"/opt/vgpu/bin/{cmd}"
    v = pkgbuild.chroot(root, "vgpu-hook", "--version")
    assert v.stdout.strip() == f"vgpu-hook {__version__}"
    h = pkgbuild.chroot(root, "vgpu-device-plugin", "--help")
    assert "--device-split-count" in h.stdout
    pkgbuild.chroot(root, "vgpu-monitor", "--help")
    pkgbuild.chroot(root, "vgpuctl", "--help")
    # The shipped config is the built-in defaults, and every daemon accepts it.
    pkgbuild.chroot(
        root,
        "/opt/vgpu/bin/python",
        "-I",
        "-c",
        "from vgpu.config import load_config, NodeConfig; "
        "assert load_config('/etc/vgpu/config.toml', missing_ok=False) == NodeConfig()",
    )
    st = os.stat(root / "var/lib/vgpu")
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == 0
    wants = root / "etc/systemd/system/multi-user.target.wants"
    for unit in UNITS:
        assert (wants / unit).is_symlink(), f"{unit} not enabled"
    # one front end per node: the DRA plugin's unit is shipped, not enabled
    assert not (wants / "vgpu-dra-plugin.service").exists()
    assert "--driver-name" in pkgbuild.chroot(root, "vgpu-dra-plugin", "--help").stdout
    assert root.joinpath("usr/lib/vgpu/libvgpu.so").stat().st_size > 0


def test_systemd_units_verify(installed: Path) -> None:
    units = [f"/usr/lib/systemd/system/{u}" for u in (*UNITS, "vgpu-dra-plugin.service")]
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={installed}", *units],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vgpu" not in r.stderr, r.stderr  # no warning about our units either
    text = (installed / "usr/lib/systemd/system/vgpu-monitor.service").read_text()
    assert "Restart=always" in text and "ExecStopPost=" in text
    plugin = (installed / "usr/lib/systemd/system/vgpu-device-plugin.service").read_text()
    assert "Restart=always" in plugin
    # ready (serving) before the kubelet starts: registered before the kubelet re-admits pods
    assert "Type=notify" in plugin and "Before=kubelet.service" in plugin
    dra = (installed / "usr/lib/systemd/system/vgpu-dra-plugin.service").read_text()
    assert "Restart=always" in dra and "Conflicts=vgpu-device-plugin.service" in dra


def test_installed_daemons_run_on_the_simulated_gpu(installed: Path, build_dir: Path) -> None:
    """The package's own venv and interpreter run the daemons: vgpu-device-plugin registers with
    the kubelet stand-in (unix sockets inside the root) and allocates; vgpu-monitor serves
    /metrics and vgpuctl reads its status."""
    from sim.fakegpu.harness import FakeGPU
    from sim.kubelet import FakeKubelet

    root = installed
    shutil.copytree(build_dir / "fakegpu", root / "opt/fakegpu", symlinks=True, dirs_exist_ok=True)
    gpu = FakeGPU(root / "tmp/fakegpu", build_dir, gpus=1, memory=8 << 30)
    env = {
        "LD_LIBRARY_PATH": "/opt/fakegpu",
        "FAKEGPU_CONFIG": "/tmp/fakegpu/fakegpu.conf",
        "FAKEGPU_STATE": "/tmp/fakegpu/fakegpu.state",
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    }
    proc = root / "proc"
    subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        with FakeKubelet(root / "tmp/kubelet") as kubelet:
            daemons.append(
                subprocess.Popen(
                    [
                        "chroot",
                        str(root),
                        "vgpu-device-plugin",
                        "--kubelet-dir",
                        "/tmp/kubelet",
                        "--device-split-count",
                        "4",
                    ],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )
            ep = kubelet.wait_endpoint("nvidia.com/gpu", timeout=60)
            ep.wait_devices(lambda d: len(d) == 4, timeout=30)
            alloc = kubelet.admit("default", "pod", "main", count=1)
            token = alloc.envs["VGPU_ALLOCATION_TOKEN"]
            record = json.loads((root / f"var/lib/vgpu/allocations/{token}.json").read_text())
            assert record["gpus"][0]["memory_limit"] == 2 << 30 and record["gpus"][0]["uuid"] == gpu.uuids[0]

            daemons.append(
                subprocess.Popen(
                    ["chroot", str(root), "vgpu-monitor", "--metrics-address", "127.0.0.1", "--metrics-port", "0"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )
            status_path = root / "var/lib/vgpu/monitor/status.json"
            deadline = time.monotonic() + 60
            port = 0
            while not port and time.monotonic() < deadline and daemons[-1].poll() is None:
                try:
                    port = int(json.loads(status_path.read_text()).get("metrics_port") or 0)
                except (OSError, ValueError):
                    time.sleep(0.1)
            assert port, "the packaged vgpu-monitor did not start"
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert f'vgpu_gpu_up{{gpu="0",uuid="{gpu.uuids[0]}"}} 1.0' in text
            st = pkgbuild.chroot(root, "vgpuctl", "status")
            assert "vgpu-monitor: running" in st.stdout and gpu.uuids[0] in st.stdout
    finally:
        for d in daemons:
            terminate(d, 20)
        gpu.close()
        subprocess.run(["umount", "-l", str(proc)], check=False)
    assert [d.returncode for d in daemons] == [0, 0]


def test_monitor_stop_path_resumes_the_ledger(installed: Path) -> None:
    """ExecStopPost's program resumes a process the ledger names (pid + start time)."""
    from monitor import ledger
    from monitor.procs import ProcKey, start_time

    victim = subprocess.Popen(["sleep", "60"])
    proc = installed / "proc"
    try:
        os.kill(victim.pid, signal.SIGSTOP)
        assert _wait_state(victim.pid, lambda s: s == "T")
        (installed / "var/lib/vgpu/monitor").mkdir(parents=True, exist_ok=True)
        started = start_time(victim.pid)
        assert started is not None
        ledger.write(str(installed / "var/lib/vgpu/monitor/ledger"), [ProcKey(victim.pid, started)])
        subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True)
        try:
            r = pkgbuild.chroot(installed, "/usr/lib/vgpu/vgpu-resume-suspended", "/etc/vgpu/config.toml")
        finally:
            subprocess.run(["umount", "-l", str(proc)], check=False)
        assert "resumed 1" in r.stdout
        assert _wait_state(victim.pid, lambda s: s != "T")
        assert ledger.read(str(installed / "var/lib/vgpu/monitor/ledger")) == set()
    finally:
        victim.kill()
        victim.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, ok: Callable[[str], bool], timeout: float = 10.0) -> bool:
    """Signals are delivered asynchronously: poll the process state."""
    deadline = time.monotonic() + timeout
    while not ok(_state(pid)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_containerd_switch_wires_and_unwires_the_hook(built: Built) -> None:
    """VGPU_CONFIGURE_CONTAINERD=1: postinst runs `vgpu-hook containerd install` (against the
    root's real containerd), the wired hook runs from the package's venv, and removal restores
    containerd's configuration byte for byte."""
    with pkgbuild.scratch_root(built.base) as root:
        conf = root / "etc/containerd/config.toml"
        original = conf.read_bytes() if conf.exists() else None
        deb = "/tmp/" + built.deb.name
        shutil.copy(built.deb, root / "tmp" / built.deb.name)
        # The scratch root has no NVIDIA container toolkit: install must be told so explicitly.
        switch = {"VGPU_CONFIGURE_CONTAINERD": "1", "VGPU_WITHOUT_NVIDIA_RUNTIME": "1"}
        r = pkgbuild.chroot(root, "dpkg", "-i", deb, env=switch)
        assert "configured (handler `vgpu`" in r.stdout, r.stdout
        doc = msgspec.toml.decode(conf.read_bytes())
        runtime = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["vgpu"]
        spec = json.loads((root / runtime["base_runtime_spec"].lstrip("/")).read_text())
        prestart = spec["hooks"]["prestart"][-1]
        assert prestart["env"] and prestart["timeout"] > 0  # explicit env: never the image's
        assert any("/opt/vgpu/" in a for a in prestart["args"])

        # The hook as runc runs it (argv, explicit env, state on stdin), inside the root.
        bundle = root / "tmp/bundle"
        (bundle / "rootfs").mkdir(parents=True)
        config: dict[str, Any] = {"ociVersion": "1.0.2", "process": {"env": ["PATH=/bin"]}, "root": {"path": "rootfs"}}
        (bundle / "config.json").write_text(json.dumps(config))
        state: dict[str, Any] = {"ociVersion": "1.0.2", "id": "plain", "status": "creating", "pid": 1}
        state["bundle"] = "/tmp/bundle"
        hook_env = dict(e.split("=", 1) for e in prestart["env"])

        def run_hook() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["chroot", str(root), *prestart["args"]],
                input=json.dumps(state),
                env=hook_env,
                capture_output=True,
                text=True,
                timeout=60,
            )

        plain = run_hook()
        assert plain.returncode == 0, plain.stderr
        token = "0" * 32  # well-formed, but no allocation record: the container must not start
        config["annotations"] = state["annotations"] = {"vgpu.k8s.io/allocation-token": token}
        (bundle / "config.json").write_text(json.dumps(config))
        state["id"] = "tokened"
        failed = run_hook()
        assert failed.returncode != 0 and "vgpu-hook" in failed.stderr, (failed.returncode, failed.stderr)

        # An upgrade re-wires the hook with the current node config (its settings are flags).
        cfg = root / "etc/vgpu/config.toml"
        cfg.write_text(cfg.read_text().replace("log_max_bytes = 4194304", "log_max_bytes = 1048576"))
        up = pkgbuild.chroot(root, "dpkg", "-i", deb)
        assert "restart containerd" in up.stdout, up.stdout
        spec = json.loads((root / runtime["base_runtime_spec"].lstrip("/")).read_text())
        assert "1048576" in spec["hooks"]["prestart"][-1]["args"]
        assert len(spec["hooks"]["prestart"]) == 1  # refreshed, not added twice

        r = pkgbuild.chroot(root, "dpkg", "-r", "k8s-vgpu", env=switch)
        assert "restored" in r.stdout, r.stdout
        if original is None:
            assert not conf.exists()
        else:
            assert conf.read_bytes() == original
        assert not (root / runtime["base_runtime_spec"].lstrip("/")).exists()
        assert not (root / "etc/containerd/config.toml.vgpu-hook.json").exists()


def test_upgrade_keeps_config_remove_and_purge(built: Built, packages: pkgbuild.Packages) -> None:
    with pkgbuild.scratch_root(built.base) as root:
        deb = "/tmp/" + packages.deb.name
        shutil.copy(packages.deb, root / "tmp" / packages.deb.name)
        pkgbuild.chroot(root, "dpkg", "-i", deb)
        cfg = root / "etc/vgpu/config.toml"
        edited = cfg.read_text().replace("device_split_count = 2", "device_split_count = 4")
        cfg.write_text(edited)
        (root / "var/lib/vgpu/allocations").mkdir()
        # Reinstall = upgrade path: the admin's edit survives, no conffile prompt.
        up = pkgbuild.chroot(root, "dpkg", "-i", deb)
        assert "Setting up k8s-vgpu" in up.stdout
        assert cfg.read_text() == edited
        # Remove: units disabled, programs gone, state and config kept.
        pkgbuild.chroot(root, "dpkg", "-r", "k8s-vgpu")
        for unit in UNITS:
            assert not (root / "etc/systemd/system/multi-user.target.wants" / unit).exists()
        assert not (root / "usr/bin/vgpu-hook").exists() and not (root / "opt/vgpu").exists()
        assert (root / "var/lib/vgpu/allocations").is_dir() and cfg.exists()
        # Purge: state, logs and the conffile go.
        pkgbuild.chroot(root, "dpkg", "-P", "k8s-vgpu")
        assert not (root / "var/lib/vgpu").exists()
        assert not (root / "var/log/vgpu").exists()
        assert not (root / "etc/vgpu").exists()


def test_lintian_has_no_errors(built: Built) -> None:
    out, err = built.lint.communicate(timeout=600)
    errors = [line for line in out.splitlines() if line.startswith("E:")]
    assert errors == [], "\n".join(errors[:40])
    assert built.lint.returncode in (0, 1), err  # 1 = tags found (warnings only, checked above)
