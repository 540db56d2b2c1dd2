"""`vgpu-hook containerd install | uninstall | print` on containerd 1.x and 2.x configs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tomlkit

from node_setup import hookcmd as cli
from node_setup.containerd.handler import ANNOTATION_GLOB
from node_setup.containerd.tomledit import edit_v2
from node_setup.hookspec import HOOK_ENV
from node_setup.nodetype.detect import detect as detect_node
from node_setup.nodetype.tomlmerge import V3_RUNTIME
from tests.support import ctrd

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
    assert ours["env"] == HOOK_ENV and ours["timeout"] == 30
    assert ours["args"][-1] == "prestart" and "--state-dir" in ours["args"]
    assert spec["hooks"]["poststop"][0]["env"] == HOOK_ENV
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
    assert rt["container_annotations"] == [ANNOTATION_GLOB]
    v3 = tomlkit.parse((root / "containerd" / "containerd-2.x-conf.d-vgpu.toml").read_text())
    assert v3["plugins"][V3_RUNTIME]["containerd"]["runtimes"]["vgpu"]["runtime_type"] == ("io.containerd.runc.v2")
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


# ---- installs on the node shapes the NVIDIA toolkit leaves (tests/runtime_hook/ctrd.make_shape) -------------

HAVE_CONTAINERD = ctrd.HAVE_CONTAINERD


def _shape(kind: str, tmp: Path, mode: str) -> tuple[ctrd.Shape, list[str]]:
    """The shape (the files NVIDIA's tools wrote), and the args that point install at it (--root
    for a host tree)."""
    if mode == "root":
        s = ctrd.make_shape(kind, tmp / "host", "")
        _host_hook(s)
        return s, ["--root", str(s.root), "--containerd-config", s.conf]
    s = ctrd.make_shape(kind, Path("/"), str(tmp / "host"))
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
    target = s.conf if kind == "n1-117" else s.dropin  # toolkit 1.20: the drop-in owns the CRI section
    doc = tomlkit.parse(s.fs(target).read_text()).unwrap()
    rts = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    vg, nv = rts["vgpu"], rts["nvidia"]
    # cdi mode: the legacy sibling only where its hook accepts (the operator's skip-mode-detection);
    # a host toolkit in cdi mode keeps the runtime in cdi mode
    binary = s.binary + ".legacy" if kind == "n3" else s.binary
    assert vg["options"] == {**nv["options"], "BinaryName": binary}  # the whole table copied
    assert vg["runtime_type"] == nv["runtime_type"]
    assert {k: v for k, v in vg.items() if k not in ("options", "base_runtime_spec", "container_annotations")} == {
        k: v for k, v in nv.items() if k not in ("options", "base_runtime_spec", "container_annotations")
    }
    assert vg["container_annotations"] == ["vgpu.k8s.io/*", "cdi.k8s.io/*"]
    spec_path = vg["base_runtime_spec"]
    assert spec_path == s.hp("/etc/containerd/vgpu-base-spec.json")  # a host path, also under --root
    spec = json.loads(s.fs(spec_path).read_text())
    args = spec["hooks"]["prestart"][-1]["args"]
    assert "/usr/local/vgpu/bin/python3" in args and "/usr/local/vgpu/runtime_hook/fastpath.py" in args
    if kind != "n1-117":  # the main file is untouched: its CRI section is not the effective one
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
    s = ctrd.make_shape("n1-118", Path("/"), str(tmp_path / "host"))
    text = s.fs(s.conf).read_text()
    s.fs(s.conf).write_text(edit_v2(text, "vgpu", {"runtime_type": "io.containerd.runc.v2"}, False))
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


def _rt(s: ctrd.Shape, target: str) -> dict[str, object]:
    doc = tomlkit.parse(s.fs(target).read_text()).unwrap()
    rts: dict[str, object] = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    return rts


def test_host_toolkit_in_cdi_mode_keeps_the_cdi_runtime(
    tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Problem: a host toolkit in cdi mode (nvidia-ctk config default + mode = "cdi") has a
    `.legacy` runtime, but its hook refuses (skip-mode-detection = false).  Install keeps the
    runtime in cdi mode and says the envvar strategy works: the CDI spec of the default kind
    (nvidia-ctk cdi generate) names the GPUs by UUID."""
    s = ctrd.make_shape("n1-cdi", tmp_path / "host", "")
    where = ["--root", str(s.root), "--containerd-config", s.conf, "--base-spec-source", str(spec_src), *_host_hook(s)]
    assert _run(tmp_path, "install", *where) == 0
    out = capsys.readouterr().out
    assert "node type N1-cdi" in out and "N3" not in out
    assert s.binary + ".legacy is not used: its hook refuses in cdi mode" in out
    assert "envvar strategy works (NVIDIA_VISIBLE_DEVICES=<uuid> becomes nvidia.com/gpu=<uuid>" in out
    assert _rt(s, s.dropin)["vgpu"]["options"]["BinaryName"] == s.binary  # type: ignore[index]


def test_operator_in_cdi_mode_uses_the_legacy_sibling_its_hook_accepts(
    tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = ctrd.make_shape("n3", tmp_path / "host", "")
    where = ["--root", str(s.root), "--containerd-config", s.conf, "--base-spec-source", str(spec_src), *_host_hook(s)]
    assert _run(tmp_path, "install", *where) == 0
    out = capsys.readouterr().out
    assert "legacy-mode sibling" in out and "skip-mode-detection = true" in out
    assert _rt(s, s.dropin)["vgpu"]["options"]["BinaryName"] == s.binary + ".legacy"  # type: ignore[index]
    # without a .legacy: cdi mode kept; the installer's management spec names no GPU by UUID
    m = ctrd.make_shape("n3", tmp_path / "host2", "")
    m.fs(m.binary + ".legacy").unlink()
    where = ["--root", str(m.root), "--containerd-config", m.conf, "--base-spec-source", str(spec_src), *_host_hook(m)]
    assert _run(tmp_path, "install", *where) == 0
    out = capsys.readouterr().out
    assert "no CDI spec of kind nvidia.com/gpu names GPUs by UUID" in out and "cdi-annotations" in out
    assert _rt(m, m.dropin)["vgpu"]["options"]["BinaryName"] == m.binary  # type: ignore[index]


@pytest.mark.parametrize("mode", ["root", "dump"] if HAVE_CONTAINERD else ["root"])
def test_refuses_a_containerd_whose_cri_cannot_load(
    mode: str, tmp_path: Path, spec_src: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Debian's config.toml + nvidia-ctk 1.20's drop-in (recorded) on containerd 1.x: the CRI
    plugin cannot load (runc missing from the replaced runtimes table).  Install says so with the
    fix and writes nothing, instead of "configured"."""
    from tests.support import traces

    root = tmp_path / "host" if mode == "root" else Path("/")
    s = ctrd.Shape("n1-118", root, "" if mode == "root" else str(tmp_path / "host"))
    rec = "nvidia-toolkit/runtime-configure/debian-plain/etc/containerd/"
    s.write(s.conf, s.moved(traces.text(rec + "config.toml")))
    s.write(s.dropin, s.moved(traces.text(rec + "conf.d/99-nvidia.toml")))
    s.write(s.hp("/usr/bin/nvidia-container-runtime"), "#!/bin/sh\n", 0o755)
    s.write(
        s.hp("/etc/nvidia-container-runtime/config.toml"), traces.text("nvidia-toolkit/nvidia-ctk-config-default.toml")
    )
    where = ["--containerd-config", s.conf, "--base-spec-source", str(spec_src)]
    where += ["--root", str(s.root), *_host_hook(s)] if mode == "root" else []
    before = s.snapshot()
    assert _run(tmp_path, "install", *where) == 1
    err = capsys.readouterr().err
    assert "containerd's CRI plugin will not load" in err
    assert (
        'no corresponding runtime configured in `containerd.runtimes` for `containerd` `default_runtime_name = "runc"'
        in err
    )
    assert "runtimes.runc] runtime_type" in err and s.dropin in err
    assert s.snapshot() == before
    assert _run(tmp_path, "print", *where) == 1  # print plans the same install


def test_base_spec_drops_the_defaults_cri_clears(tmp_path: Path) -> None:
    """`ctr oci spec` (recorded, 1.6.20) carries RLIMIT_NOFILE 1024/1024, which CRI clears for a
    handler without base_runtime_spec (WithoutDefaultSecuritySettings): our base spec must not
    bring it back.  Everything else of the default spec stays, plus our hooks."""
    from tests.support import traces

    src = traces.path("containerd-cri/ctr-oci-spec.containerd-1.6.20.json")
    ctr = json.loads(src.read_text())
    assert ctr["process"]["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    assert _run(tmp_path, "install", "--containerd-config", str(conf), "--base-spec-source", str(src),
                "--containerd-version", "1", NO_NV) == 0  # fmt: skip
    spec = json.loads((tmp_path / "vgpu-base-spec.json").read_text())
    assert "rlimits" not in spec["process"] and "apparmorProfile" not in spec["process"]
    assert "seccomp" not in spec["linux"]
    hooks = spec.pop("hooks")
    assert [h["args"][3] for h in hooks["prestart"] + hooks["poststop"]] == ["vgpu-hook", "vgpu-hook"]
    del ctr["process"]["rlimits"]
    assert spec == ctr


def test_2x_install_on_the_default_version_4_config(tmp_path: Path, spec_src: Path) -> None:
    """containerd 2.3's own default config (version 4, imports conf.d already): our drop-in only."""
    from tests.support import traces

    conf = tmp_path / "etc/containerd/config.toml"
    conf.parent.mkdir(parents=True)
    text = traces.text("containerd2/config-default.containerd-2.3.4.toml")
    conf.write_text(text.replace("'/etc/containerd/conf.d/*.toml'", f"'{conf.parent}/conf.d/*.toml'"))
    original = conf.read_bytes()
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), NO_NV]
    assert _run(tmp_path, "install", *common) == 0
    assert conf.read_bytes() == original  # the import is there already
    drop = tomlkit.parse((conf.parent / "conf.d" / "vgpu.toml").read_text()).unwrap()
    assert drop["version"] == 3 and "vgpu" in drop["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    f = detect_node(str(conf), containerd_bin=str(tmp_path / "none"), major=2)
    assert f.handler("vgpu") is not None and f.handler("runc") is not None and f.cri_error == ""
    assert _run(tmp_path, "uninstall", "--containerd-config", str(conf)) == 0
    assert conf.read_bytes() == original and not (conf.parent / "conf.d" / "vgpu.toml").exists()


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
    s = ctrd.make_shape("n1-117", tmp_path / "host", "")
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
    s = ctrd.make_shape("n2", tmp_path / "host", "")
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
