"""`vgpu-hook containerd install | uninstall | print` on containerd 1.x and 2.x configs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import tomlkit

from runtime_hook import cli, containerd

pytestmark = pytest.mark.timeout(120)

V1_CONFIG = """# my node's containerd config
version = 2
root = "/var/lib/containerd"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"   # pinned by ops
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
"""

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


def test_v1_install_is_in_place_idempotent_and_uninstall_restores(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    conf.write_text(V1_CONFIG)
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1"]
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
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1"]
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
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src)]
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
    args = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "2"]
    assert _run(tmp_path, "install", *args) == 1
    assert "version = 3" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("containerd") is None, reason="containerd not installed")
def test_missing_config_starts_from_containerd_default(tmp_path: Path, spec_src: Path) -> None:
    conf = tmp_path / "config.toml"
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1"]
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
    common = ["--containerd-config", str(conf), "--base-spec-source", str(spec_src), "--containerd-version", "1"]
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
