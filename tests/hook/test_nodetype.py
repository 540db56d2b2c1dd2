"""Node detection (runtime_hook.nodetype) on each node shape, from files and from `containerd config dump`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from runtime_hook import nodetype
from tests.hook import ctrd

pytestmark = pytest.mark.timeout(120)

BASE = ctrd.V1_CONFIG

HAVE_CONTAINERD = ctrd.HAVE_CONTAINERD


def _modes() -> list[str]:
    return ["root", "dump"] if HAVE_CONTAINERD else ["root"]


def shape(kind: str, tmp: Path, mode: str) -> ctrd.Shape:
    if mode == "root":  # a host tree under --root, no containerd binary in it: files parsed
        return ctrd.make_shape(kind, tmp / "host", "", base_text=BASE)
    return ctrd.make_shape(kind, Path("/"), str(tmp / "host"), base_text=BASE)


def detect(s: ctrd.Shape, mode: str, **kw: object) -> nodetype.NodeFacts:
    root = str(s.root) if mode == "root" else "/"
    return nodetype.detect(s.conf, root=root, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("kind", ctrd.SHAPES)
def test_each_shape(kind: str, mode: str, tmp_path: Path) -> None:
    s = shape(kind, tmp_path, mode)
    f = detect(s, mode)
    assert f.node_type == ctrd.EXPECTED_TYPE[kind]
    assert f.source == ("config dump" if mode == "dump" else "files"), f.source_note
    assert f.config_version == 2 and f.cri_plugin == "io.containerd.grpc.v1.cri"
    assert f.nvidia_handler == "nvidia"
    nv = f.handler("nvidia")
    assert nv is not None and nv.binary_name == s.binary and nv.binary_exists and nv.nvidia
    assert nv.table["options"]["SystemdCgroup"] is True  # the whole table (copied from runc by the toolkit)
    assert f.toolkit is not None and f.toolkit.exists and f.toolkit.path == s.toolkit_config
    assert f.toolkit.accept_envvar_unprivileged is True and f.toolkit.accept_volume_mounts is False
    assert f.toolkit.annotation_prefixes == ["cdi.k8s.io/"]
    if mode == "dump":
        assert f.containerd_version.startswith("1.")
    if kind == "n1-117":
        assert f.default_runtime == "nvidia" and f.cri_file == s.conf and f.files == [s.conf]
        assert f.toolkit.mode == "auto" and not f.cdi_enabled
    if kind == "n1-118":
        drop = s.hp("/etc/containerd/conf.d/99-nvidia.toml")
        assert f.files == [s.conf, drop] and f.cri_file == drop  # the drop-in owns the CRI section
        assert f.default_runtime == "runc"
        runc = f.handler("runc")
        assert runc is not None and runc.table["options"]["SystemdCgroup"] is True
    if kind in ("n2", "n3"):
        names = {h.name for h in f.handlers if h.nvidia}
        assert names == {"nvidia", "nvidia-cdi", "nvidia-legacy"}
        assert f.legacy_binary == s.binary + ".legacy"
        assert f.handler("nvidia-cdi").binary_name.endswith(".cdi")  # type: ignore[union-attr]
    if kind == "n2":
        assert f.default_runtime == "nvidia" and f.toolkit.mode == "auto"
    if kind == "n3":
        assert f.default_runtime == "runc"
        assert f.toolkit.mode == "cdi" and f.toolkit.default_kind == "management.nvidia.com/gpu"
        if mode == "root":  # parsed files: containerd 1.7's keys as written
            assert f.cdi_enabled and f.cdi_spec_dirs == [s.hp("/etc/cdi"), s.hp("/var/run/cdi")]
        else:  # Debian's containerd 1.6 has no CDI: its dump drops enable_cdi, and detection says so
            assert not f.cdi_enabled and any("ignores enable_cdi" in n for n in f.notes)
        assert [(c.kind, c.devices) for c in f.cdi_specs] == [("management.nvidia.com/gpu", ["all"])]
    # the facts are one msgspec struct: JSON round trip
    assert json.loads(nodetype.to_json(f))["node_type"] == f.node_type
    assert f"node type: {f.node_type}" in nodetype.summary(f)


def test_no_nvidia_runtime_and_empty_node(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(BASE)
    f = nodetype.detect("/etc/containerd/config.toml", root=str(host))
    assert f.node_type == "none" and f.nvidia_handler == "" and f.toolkit is None
    assert [h.name for h in f.handlers] == ["runc"]
    empty = nodetype.detect("/etc/containerd/config.toml", root=str(tmp_path / "nothing"))
    assert empty.node_type == "none" and not empty.config_exists and empty.handlers == []
    assert "does not exist" in empty.source_note and empty.containerd_version == ""


def test_merge_rules_1x_replace_2x_merge(tmp_path: Path) -> None:
    """1.x: a later file's CRI section replaces the whole earlier one; 2.x merges deeply."""
    host = tmp_path / "host"
    (host / "etc/containerd/conf.d").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text('imports = ["conf.d/*.toml"]\n' + BASE)  # relative import
    (host / "etc/containerd/conf.d/50-extra.toml").write_text(
        "version = 2\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    )
    eff, order, _ = nodetype.load_files(nodetype.Root(str(host)), "/etc/containerd/config.toml", 1)
    assert order == ["/etc/containerd/config.toml", "/etc/containerd/conf.d/50-extra.toml"]
    rts = eff["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert list(rts) == ["nvidia"]  # runc and sandbox_image are gone (containerd #5837)
    assert "sandbox_image" not in eff["plugins"]["io.containerd.grpc.v1.cri"]
    eff2, _, _ = nodetype.load_files(nodetype.Root(str(host)), "/etc/containerd/config.toml", 2)
    rts2 = eff2["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert sorted(rts2) == ["nvidia", "runc"]
    if HAVE_CONTAINERD:  # containerd 1.6 itself agrees with our 1.x rule
        s = tmp_path / "real"
        (s / "conf.d").mkdir(parents=True)
        (s / "config.toml").write_text(f'imports = ["{s}/conf.d/*.toml"]\n' + BASE)
        shutil.copy(host / "etc/containerd/conf.d/50-extra.toml", s / "conf.d")
        f = nodetype.detect(str(s / "config.toml"))
        assert f.source == "config dump" and f.handler("runc") is None and f.handler("nvidia") is not None


def test_root_resolves_symlinks_inside_the_root(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "opt/ctr").mkdir(parents=True)
    (host / "opt/ctr/config.toml").write_text(BASE)
    (host / "etc/containerd").mkdir(parents=True)
    os.symlink("/opt/ctr/config.toml", host / "etc/containerd/config.toml")  # absolute: the host's /opt
    r = nodetype.Root(str(host))
    assert r.fs("/etc/containerd/config.toml") == str(host / "opt/ctr/config.toml")
    os.symlink("../../../../../../etc/passwd", host / "etc/up")
    assert r.fs("/etc/up") == str(host / "etc/passwd")  # `..` never leaves the root
    assert nodetype.detect("/etc/containerd/config.toml", root=str(host)).config_exists


def test_toolkit_config_overrides_and_bad_files(tmp_path: Path) -> None:
    s = ctrd.make_shape("n1-117", tmp_path / "host", "", base_text=BASE)
    (tmp_path / "host/etc/tk.toml").write_text('[nvidia-container-runtime]\nmode = "legacy"\n')
    f = nodetype.detect(s.conf, root=str(s.root), toolkit_config="/etc/tk.toml")
    assert f.toolkit is not None and f.toolkit.path == "/etc/tk.toml" and f.node_type == "N1-legacy"
    s.fs(s.toolkit_config).write_text("mode = [unclosed\n")
    f = nodetype.detect(s.conf, root=str(s.root))
    assert f.toolkit is not None and "cannot parse" in f.toolkit.error
    s.fs(s.conf).write_text("version = = 2\n")
    with pytest.raises(nodetype.DetectError, match="cannot parse"):
        nodetype.detect(s.conf, root=str(s.root))
    s.fs(s.conf).write_text('version = "2"\n')
    with pytest.raises(nodetype.DetectError, match="unsupported config version"):
        nodetype.detect(s.conf, root=str(s.root))


def test_jit_cdi_explicit_and_yaml_specs(tmp_path: Path) -> None:
    s = ctrd.make_shape("n1-117", tmp_path / "host", "", base_text=BASE)
    s.fs(s.toolkit_config).write_text('[nvidia-container-runtime]\nmode = "jit-cdi"\n')
    s.write("/var/run/cdi/nvidia.yaml", "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n"
            "  containerEdits: {}\n- name: GPU-abc\n  containerEdits: {}\n- name: all\n")  # fmt: skip
    f = nodetype.detect(s.conf, root=str(s.root))
    assert f.node_type == "N1-jit-cdi"
    assert [(c.kind, c.devices) for c in f.cdi_specs] == [("nvidia.com/gpu", ["0", "GPU-abc", "all"])]
