"""`vgpu-hook containerd install | uninstall | print` on containerd 1.x and 2.x configs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tomlkit

from runtime_hook import cli, containerd
from tests.hook import ctrd

pytestmark = pytest.mark.timeout(120)

V1_CONFIG = ctrd.V1_CONFIG

V3_CONFIG = """version = 3
# containerd 2 config

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
"""


@pytest.fixture
def spec_src(tmp_path: Path) -> Path:
    p = tmp_path / "default-spec.json"
    p.write_text(json.dumps({"ociVersion": "1.0.2", "process": {"cwd": "/"}, "hooks": {"prestart": [{"path": "/x"}]}}))
    return p


def _run(tmp: Path, *args: str) -> int:
    return cli.main(["--config", str(tmp / "none.toml"), "--state-dir", str(tmp / "state"), "containerd", *args])


NO_NV = "--without-nvidia-runtime"  # these configs have no NVIDIA runtime (the simulator's case)


def test_v1_install_is_in_place_idempotent_and_uninstall_restores(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1", NO_NV]
    assert _run(tmp_path, "install", *common, "--default") == 0
    first = conf.read_text()
    assert _run(tmp_path, "install", *common, "--default") == 0
    assert conf.read_text() == first  # idempotent
    doc = tomlkit.parse(first)
    ctd = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert ctd["default_runtime_name"] == "vgpu"
    rt = ctd["runtimes"]["vgpu"]
    assert rt["runtime_type"] == "io.containerd.runc.v2"
    assert rt["container_annotations"] == ["vgpu.k8s.io/*"]
    assert rt["options"]["SystemdCgroup"] is True  # copied from runc
    # everything else, comments included, preserved
    assert "# pinned by ops" in first and "# my node's containerd config" in first
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"] == "registry.k8s.io/pause:3.9"
    spec = json.loads(Path(rt["base_runtime_spec"]).read_text())
    pre = spec["hooks"]["prestart"]
    assert pre[0] == {"path": "/x"} and len(pre) == 2  # existing hooks kept, ours appended once
    ours = pre[1]
    assert ours["env"] == containerd.HOOK_ENV and ours["timeout"] == 30
    assert ours["args"][-1] == "prestart" and "--state-dir" in ours["args"]
    assert spec["hooks"]["poststop"][0]["env"] == containerd.HOOK_ENV
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_text() == V1_CONFIG
    assert not Path(rt["base_runtime_spec"]).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "default-spec.json"]
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0  # idempotent


def test_v1_uninstall_after_admin_edit_removes_only_ours(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1", NO_NV]
    assert _run(tmp_path, "install", *common, "--default") == 0
    conf.write_text(conf.read_text().replace('root = "/var/lib/containerd"', 'root = "/data/containerd"'))
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    doc = tomlkit.parse(conf.read_text())
    ctd = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert "vgpu" not in ctd["runtimes"] and ctd["default_runtime_name"] == "runc"
    assert doc["root"] == "/data/containerd"


def test_v2_dropin_and_imports(tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(V3_CONFIG)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), NO_NV]
    assert _run(tmp_path, "print", *common) == 0
    out = capsys.readouterr().out
    assert "+imports = [" in out and "conf.d/vgpu.toml" in out
    assert conf.read_text() == V3_CONFIG  # print changes nothing
    assert _run(tmp_path, "install", *common) == 0
    doc = tomlkit.parse(conf.read_text())
    assert doc["imports"] == [str(tmp_path / "conf.d" / "*.toml")]
    drop = tomlkit.parse((tmp_path / "conf.d" / "vgpu.toml").read_text())
    assert drop["version"] == 3
    rt = drop["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["vgpu"]
    assert rt["runtime_type"] == "io.containerd.runc.v2" and rt["container_annotations"] == ["vgpu.k8s.io/*"]
    assert _run(tmp_path, "install", *common) == 0
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_text() == V3_CONFIG
    assert not (tmp_path / "conf.d" / "vgpu.toml").exists()


def test_v2_refuses_version2_main_config(tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text("version = 2\n")
    args = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "2", NO_NV]
    assert _run(tmp_path, "install", *args) == 1
    assert "version = 3" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("containerd") is None, reason="containerd not installed")
def test_missing_config_starts_from_containerd_default(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1", NO_NV]
    assert _run(tmp_path, "install", *common) == 0
    default = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True).stdout
    doc = tomlkit.parse(conf.read_text())
    assert "vgpu" in doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert "runc" in doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert len(conf.read_text()) > len(default)
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert not conf.exists()


def test_packaged_snippets_match_the_installer() -> None:
    root = Path(__file__).resolve().parents[2] / "packaging"
    v1 = tomlkit.parse((root / "containerd" / "containerd-1.x-config.toml").read_text())
    rt = v1["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["vgpu"]
    assert rt["container_annotations"] == [containerd.ANNOTATION_GLOB]
    v3 = tomlkit.parse((root / "containerd" / "containerd-2.x-conf.d-vgpu.toml").read_text())
    assert v3["plugins"][containerd.V3_RUNTIME]["containerd"]["runtimes"]["vgpu"]["runtime_type"] == (
        "io.containerd.runc.v2"
    )
    assert "handler: vgpu" in (root / "k8s" / "runtimeclass.yaml").read_text()


def test_installed_spec_never_matches_the_filter_patterns(tmp_path: Path, spec_src: Path) -> None:
    """The filter greps config.json, which contains the filter itself: its own text must not match."""
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1", NO_NV]
    assert _run(tmp_path, "install", *common) == 0
    spec = json.loads((tmp_path / "vgpu-base-spec.json").read_text())
    script = spec["hooks"]["prestart"][-1]["args"][2]
    assert not set("&<>") & set(script), "Go's encoder (containerd) would write these as \\u00XX"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    state = json.dumps({"id": "x", "bundle": str(bundle)}, separators=(",", ":")).encode()  # as runc writes it

    def filtered(config_json: str) -> bool:
        (bundle / "config.json").write_text(config_json)
        r = subprocess.run(["/bin/sh", "-c", script, "vgpu-hook", "prestart", "/bin/echo", "PYTHON"], input=state,
                           capture_output=True)  # fmt: skip
        return r.returncode == 0 and r.stdout == b""

    assert filtered(json.dumps(spec))  # the spec with our own hooks in it: no token
    assert filtered('{"process":{"args":["sh","-c","a \\u0026\\u0026 b \\u003e c"]}}')  # Go's escapes of &, >
    assert not filtered(json.dumps({**spec, "process": {"env": ["VGPU_ALLOCATION_TOKEN=x"]}}))
    assert not filtered(json.dumps({**spec, "annotations": {"vgpu.k8s.io/allocation-token": "x"}}))
    assert not filtered('{"process":{"env":["\\u0056GPU_ALLOCATION_TOKEN=x"]}}')  # an escaped letter


# ---- installs on the node shapes the NVIDIA toolkit leaves (tests/hook/ctrd.make_shape) -------------

HAVE_CONTAINERD = ctrd.HAVE_CONTAINERD


def _shape(kind: str, tmp: Path, mode: str) -> tuple[ctrd.Shape, list[str]]:
    """The shape, and the args that point install at it (--root for a host tree)."""
    if mode == "root":
        s = ctrd.make_shape(kind, tmp / "host", "", base_text=V1_CONFIG)
        _host_hook(s)
        return s, ["--root", str(s.root), "--containerd-config", s.conf]
    s = ctrd.make_shape(kind, Path("/"), str(tmp / "host"), base_text=V1_CONFIG)
    return s, ["--containerd-config", s.conf]


def _host_hook(s: ctrd.Shape) -> list[str]:
    """The host's interpreter and hook as an installer names them (they must exist under --root)."""
    s.write("/usr/local/vgpu/bin/python3", "#!/bin/false\n", 0o755)
    s.write("/usr/local/vgpu/runtime_hook/fastpath.py", "# the hook\n")
    return ["--python", "/usr/local/vgpu/bin/python3", "--hook-path", "/usr/local/vgpu/runtime_hook/fastpath.py"]


def _dump(conf: str) -> dict[str, object]:
    out = subprocess.run(["containerd", "--config", conf, "config", "dump"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return tomlkit.parse(out.stdout).unwrap()


@pytest.mark.parametrize("mode", ["root", "dump"] if HAVE_CONTAINERD else ["root"])
@pytest.mark.parametrize("kind", ctrd.SHAPES)
def test_install_on_each_shape_copies_the_nvidia_handler_and_restores_bytes(
    kind: str, mode: str, tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, where = _shape(kind, tmp_path, mode)
    before = s.snapshot()
    common = [*where, "--base-spec-source", str(spec_src), "--python", "/usr/local/vgpu/bin/python3",
              "--hook-path", "/usr/local/vgpu/runtime_hook/fastpath.py"]  # fmt: skip
    assert _run(tmp_path, "print", *common) == 0
    out = capsys.readouterr().out
    assert f"# node type: {ctrd.EXPECTED_TYPE[kind]}" in out and "# handler `vgpu`: a copy of handler `nvidia`" in out
    assert s.snapshot() == before  # print writes nothing
    assert _run(tmp_path, "install", *common) == 0
    msg = capsys.readouterr().out
    assert f"node type {ctrd.EXPECTED_TYPE[kind]}" in msg
    drop = s.hp("/etc/containerd/conf.d/99-nvidia.toml")
    target = drop if kind == "n1-118" else s.conf
    doc = tomlkit.parse(s.fs(target).read_text()).unwrap()
    rts = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    vg, nv = rts["vgpu"], rts["nvidia"]
    binary = s.binary + ".legacy" if kind == "n3" else s.binary  # cdi mode: the legacy sibling
    assert vg["options"] == {**nv["options"], "BinaryName": binary}  # the whole table copied
    assert vg["runtime_type"] == nv["runtime_type"] and vg["options"]["SystemdCgroup"] is True
    assert vg["container_annotations"] == ["vgpu.k8s.io/*", "cdi.k8s.io/*"]
    spec_path = vg["base_runtime_spec"]
    assert spec_path == s.hp("/etc/containerd/vgpu-base-spec.json")  # a host path, also under --root
    spec = json.loads(s.fs(spec_path).read_text())
    args = spec["hooks"]["prestart"][-1]["args"]
    assert "/usr/local/vgpu/bin/python3" in args and "/usr/local/vgpu/runtime_hook/fastpath.py" in args
    if kind == "n1-118":  # the main file is untouched: its CRI section is not the effective one
        assert s.fs(s.conf).read_bytes() == before[os.path.relpath(s.conf, s.hp("/"))]
    if mode == "dump":  # containerd itself sees the handler after the merge
        eff = _dump(s.conf)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]  # type: ignore[index]
        assert eff["vgpu"]["options"]["BinaryName"] == binary and eff["vgpu"]["base_runtime_spec"] == spec_path
        assert "nvidia" in eff and "runc" in eff
    assert _run(tmp_path, "install", *common) == 0  # idempotent
    assert s.fs(target).read_text() == tomlkit.dumps(tomlkit.parse(s.fs(target).read_text()))
    assert _run(tmp_path, "uninstall", *where) == 0
    assert s.snapshot() == before  # every file, byte for byte; backups and sidecar gone


def test_handler_in_the_main_file_is_lost_under_99_nvidia(tmp_path: Path) -> None:
    """Why install edits the drop-in on 1.x: containerd 1.6 drops a handler added to the main file."""
    if not HAVE_CONTAINERD:
        pytest.skip("containerd not installed")
    s = ctrd.make_shape("n1-118", Path("/"), str(tmp_path / "host"), base_text=V1_CONFIG)
    text = s.fs(s.conf).read_text()
    s.fs(s.conf).write_text(containerd.edit_v2(text, "vgpu", {"runtime_type": "io.containerd.runc.v2"}, False))
    eff = _dump(s.conf)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]  # type: ignore[index]
    assert "vgpu" not in eff and "nvidia" in eff


def test_refuses_without_nvidia_runtime(tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    args = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1"]
    assert _run(tmp_path, "install", *args) == 1
    err = capsys.readouterr().err
    assert "no NVIDIA container runtime" in err and "nvidia-ctk runtime configure" in err
    assert "--without-nvidia-runtime" in err
    assert conf.read_text() == V1_CONFIG and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.toml", "default-spec.json"]  # fmt: skip
    assert _run(tmp_path, "install", *args, "--nvidia-runtime", "/opt/nv/nvidia-container-runtime") == 0
    rt = tomlkit.parse(conf.read_text())["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["vgpu"]
    assert rt["options"]["BinaryName"] == "/opt/nv/nvidia-container-runtime" and rt["options"]["SystemdCgroup"]
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_text() == V1_CONFIG


def test_n3_without_legacy_binary_keeps_cdi_and_says_what_the_plugin_needs(
    tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = ctrd.make_shape("n3", tmp_path / "host", "", base_text=V1_CONFIG)
    s.fs(s.binary + ".legacy").unlink()
    where = ["--root", str(s.root), "--containerd-config", s.conf, "--base-spec-source", str(spec_src), *_host_hook(s)]
    assert _run(tmp_path, "install", *where) == 0
    out = capsys.readouterr().out
    assert "cdi-annotations" in out and "management.nvidia.com/gpu" in out
    rt = tomlkit.parse(s.fs(s.conf).read_text())["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert rt["vgpu"]["options"]["BinaryName"] == s.binary


def test_v2_dropin_copies_the_nvidia_handler(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(
        V3_CONFIG + '\n[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.runc.v2"\n'
        '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\nSystemdCgroup = true\n'
    )
    original = conf.read_bytes()
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src)]
    assert _run(tmp_path, "install", *common) == 0
    drop = tomlkit.parse((tmp_path / "conf.d" / "vgpu.toml").read_text()).unwrap()
    rt = drop["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["vgpu"]
    assert rt["options"] == {"BinaryName": "/usr/bin/nvidia-container-runtime", "SystemdCgroup": True}
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_bytes() == original and not (tmp_path / "conf.d" / "vgpu.toml").exists()


def test_root_needs_host_paths_for_the_hook(tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = ctrd.make_shape("n1-117", tmp_path / "host", "", base_text=V1_CONFIG)
    before = s.snapshot()
    where = ["--root", str(s.root), "--containerd-config", s.conf, "--base-spec-source", str(spec_src)]
    assert _run(tmp_path, "install", *where) == 1  # this interpreter's path means nothing on the host
    assert "pass --python" in capsys.readouterr().err and s.snapshot() == before
    s.write("/etc/vgpu/config.toml", '[hook]\nlibrary_path = "/usr/local/vgpu/libvgpu.so"\n')
    assert cli.main(["--config", "/etc/vgpu/config.toml", "containerd", "install", *where, *_host_hook(s)]) == 0
    spec = json.loads(s.fs("/etc/containerd/vgpu-base-spec.json").read_text())
    args = spec["hooks"]["prestart"][-1]["args"]
    assert args[args.index("--library-path") + 1] == "/usr/local/vgpu/libvgpu.so"  # node config read under --root
    assert args[args.index("--config") + 1] == "/etc/vgpu/config.toml"  # and named by its host path


def test_detect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = ctrd.make_shape("n2", tmp_path / "host", "", base_text=V1_CONFIG)
    assert _run(tmp_path, "detect", "--root", str(s.root), "--json") == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["node_type"] == "N2" and facts["nvidia_handler"] == "nvidia"
    assert facts["legacy_binary"] == "/usr/local/nvidia/toolkit/nvidia-container-runtime.legacy"


DEBIAN_SHIPPED = """version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""  # /etc/containerd/config.toml of Debian 12's containerd 1.6.20 package: no runtimes section


@pytest.mark.parametrize("dump", [True, False] if HAVE_CONTAINERD else [False])
def test_v1_file_without_runtimes_keeps_the_implicit_runc(tmp_path: Path, spec_src: Path, dump: bool) -> None:
    """containerd 1.x replaces its built-in `runtimes` map with a file's: adding `vgpu` alone to a
    config that relied on the implicit `runc` would leave the default runtime undefined (the CRI
    plugin then refuses to load).  Install writes the effective handlers explicitly too."""
    conf = tmp_path / "config.toml"
    conf.write_text(DEBIAN_SHIPPED)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), NO_NV]
    if not dump:
        common += ["--containerd-bin", str(tmp_path / "no-containerd")]
    assert _run(tmp_path, "install", *common) == 0
    first = conf.read_text()
    runtimes = tomlkit.parse(first)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert set(runtimes) == {"runc", "vgpu"}
    assert runtimes["runc"]["runtime_type"] == "io.containerd.runc.v2"
    if HAVE_CONTAINERD:  # what containerd itself makes of the file
        eff = _dump(str(conf))["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]  # type: ignore[index]
        assert eff["default_runtime_name"] == "runc" and {"runc", "vgpu"} <= set(eff["runtimes"])
    assert _run(tmp_path, "install", *common) == 0
    assert conf.read_text() == first  # idempotent: the second run sees the explicit runc
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_text() == DEBIAN_SHIPPED
