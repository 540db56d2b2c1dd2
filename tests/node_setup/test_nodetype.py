"""Node detection (node_setup.nodetype) on each node shape, from files and from `containerd config dump`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from node_setup.nodetype import report
from node_setup.nodetype.detect import detect as detect_node
from node_setup.nodetype.facts import NodeFacts
from node_setup.nodetype.root import DetectError, Root
from node_setup.nodetype.tomlmerge import load_files
from tests.support import ctrd

pytestmark = pytest.mark.timeout(120)

BASE = ctrd.V1_CONFIG

HAVE_CONTAINERD = ctrd.HAVE_CONTAINERD


def _modes() -> list[str]:
    return ["root", "dump"] if HAVE_CONTAINERD else ["root"]


def shape(kind: str, tmp: Path, mode: str) -> ctrd.Shape:
    """The node shape as NVIDIA's tools wrote it (the recorded files)."""
    if mode == "root":  # a host tree under --root, no containerd binary in it: files parsed
        return ctrd.make_shape(kind, tmp / "host", "")
    return ctrd.make_shape(kind, Path("/"), str(tmp / "host"))


def detect(s: ctrd.Shape, mode: str, **kw: object) -> NodeFacts:
    root = str(s.root) if mode == "root" else "/"
    return detect_node(s.conf, root=root, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("kind", ctrd.SHAPES)
def test_each_shape(kind: str, mode: str, tmp_path: Path) -> None:
    s = shape(kind, tmp_path, mode)
    f = detect(s, mode)
    assert f.node_type == ctrd.EXPECTED_TYPE[kind]
    assert f.source == ("config dump" if mode == "dump" else "files"), f.source_note
    assert f.config_version == 2 and f.cri_plugin == "io.containerd.grpc.v1.cri"
    assert f.cri_error == ""  # every shape's CRI plugin loads
    assert f.nvidia_handler == "nvidia"
    nv = f.handler("nvidia")
    assert nv is not None and nv.binary_name == s.binary and nv.binary_exists and nv.nvidia
    assert f.toolkit is not None and f.toolkit.exists and f.toolkit.path == s.toolkit_config
    assert f.toolkit.accept_envvar_unprivileged is True and f.toolkit.accept_volume_mounts is False
    assert f.toolkit.annotation_prefixes == ["cdi.k8s.io/"]
    if mode == "dump":
        assert f.containerd_version.startswith("1.")
    if kind == "n1-117":
        assert f.default_runtime == "nvidia" and f.cri_file == s.conf and f.files == [s.conf]
        assert f.toolkit.mode == "auto" and not f.cdi_enabled
        assert nv.table["options"]["SystemdCgroup"] is True  # the whole table (copied from runc by the toolkit)
        return
    # toolkit 1.20: the drop-in carries a copy of the whole CRI section; the main file only imports it
    assert f.files == [s.conf, s.dropin] and f.cri_file == s.dropin
    assert nv.table["runtime_type"] == "io.containerd.runc.v2" and nv.table["options"]["SystemdCgroup"] is False
    runc = f.handler("runc")
    assert runc is not None and runc.table["runtime_type"] == "io.containerd.runc.v2"
    assert f.toolkit.skip_mode_detection is (kind in ("n2", "n3"))  # only the operator's installer sets it
    if kind in ("n1-118", "n1-cdi"):
        assert f.default_runtime == "runc"
        assert f.legacy_binary == s.binary + ".legacy"  # the host packages ship it too
        assert f.toolkit.mode == ("cdi" if kind == "n1-cdi" else "auto")
    if kind in ("n2", "n3"):
        names = {h.name for h in f.handlers if h.nvidia}
        assert names == {"nvidia", "nvidia-cdi", "nvidia-legacy"}
        assert f.default_runtime == "nvidia"
        assert f.legacy_binary == s.binary + ".legacy"
        assert f.handler("nvidia-cdi").binary_name.endswith(".cdi")  # type: ignore[union-attr]
        assert f.toolkit.mode == ("cdi" if kind == "n3" else "auto")
    if kind in ("n1-cdi", "n3"):
        if mode == "root":  # parsed files: containerd 1.7's keys as written
            assert f.cdi_enabled
        else:  # Debian's containerd 1.6 has no CDI: its dump drops enable_cdi, and detection says so
            assert not f.cdi_enabled and any("ignores enable_cdi" in n for n in f.notes)
    if kind == "n1-cdi":  # nvidia-ctk cdi generate: devices by index and UUID, and all
        assert [(c.kind, c.devices) for c in f.cdi_specs] == [
            ("nvidia.com/gpu", ["0", "GPU-0cf1b5a4-fb54-4cf0-abc9-7ae0c47f0105", "all"])
        ]
    if kind == "n3":  # the installer's management spec (YAML) holds only `all`
        assert [(c.kind, c.devices) for c in f.cdi_specs] == [("management.nvidia.com/gpu", ["all"])]
    # the facts are one msgspec struct: JSON round trip
    assert json.loads(report.to_json(f))["node_type"] == f.node_type
    assert f"node type: {f.node_type}" in report.summary(f)


@pytest.mark.parametrize(
    ("folder", "base", "runtimes", "default", "cdi"),
    [
        (f"runtime-configure/{b}-{v}", b, "host", "nvidia" if v == "set-as-default" else None, v == "cdi-enabled")
        for b in ("default", "debian")
        for v in ("plain", "set-as-default", "cdi-enabled")
    ]
    + [
        ("installer/default", "default", "operator", "nvidia", False),
        ("installer/cdi", "default", "operator", "nvidia", True),
    ],
)
def test_runtime_configure_model_writes_what_nvidia_ctk_wrote(
    folder: str, base: str, runtimes: str, default: str | None, cdi: bool
) -> None:
    """ctrd.runtime_configure (the shapes a containerd test runs) against the files nvidia-ctk 1.20
    and its installer really wrote from the same base config: the same TOML, main file and drop-in."""
    import tomllib

    from tests.support import traces

    base_text = traces.text(
        "nvidia-toolkit/bases/"
        + ("containerd-1.6.20-config-default.toml" if base == "default" else "debian-12-etc-containerd-config.toml")
    )
    tk = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
    names = (
        {"nvidia": "/usr/bin/nvidia-container-runtime"}
        if runtimes == "host"
        else {"nvidia": tk, "nvidia-cdi": tk + ".cdi", "nvidia-legacy": tk + ".legacy"}
    )
    main, drop = ctrd.runtime_configure(base_text, names, set_as_default=default, cdi=cdi)
    rec = f"nvidia-toolkit/{folder}/etc/containerd/"
    assert tomllib.loads(main) == tomllib.loads(traces.text(rec + "config.toml"))
    assert tomllib.loads(drop) == tomllib.loads(traces.text(rec + "conf.d/99-nvidia.toml"))


@pytest.mark.parametrize("mode", _modes())
@pytest.mark.parametrize("variant", ["plain", "cdi-enabled", "set-as-default"])
def test_debian_config_plus_nvidia_ctk_drop_in_cannot_load_cri(variant: str, mode: str, tmp_path: Path) -> None:
    """Debian's shipped config.toml has no runtimes; toolkit 1.20's drop-in copies its CRI section
    plus `nvidia` only.  On containerd 1.x the drop-in replaces the CRI section, so
    default_runtime_name (runc) names no runtime: the CRI plugin refuses to load
    (ValidatePluginConfig).  --set-as-default makes `nvidia` the default: that one loads."""
    from tests.support import traces

    prefix = "" if mode == "root" else str(tmp_path / "host")
    root = tmp_path / "host" if mode == "root" else Path("/")
    s = ctrd.Shape("n1-118", root, prefix)
    rec = f"nvidia-toolkit/runtime-configure/debian-{variant}/etc/containerd/"
    s.write(s.conf, s.moved(traces.text(rec + "config.toml")))
    s.write(s.dropin, s.moved(traces.text(rec + "conf.d/99-nvidia.toml")))
    s.write(s.hp("/usr/bin/nvidia-container-runtime"), "#!/bin/sh\n", 0o755)
    f = detect(s, mode)
    assert f.cri_file == s.dropin and [h.name for h in f.handlers] == ["nvidia"]
    if variant == "set-as-default":
        assert f.cri_error == "" and f.default_runtime == "nvidia"
        return
    assert f.cri_error == (
        'no corresponding runtime configured in `containerd.runtimes` for `containerd` `default_runtime_name = "runc"'
    )
    assert any("CRI plugin will NOT load" in ln for ln in report.summary(f))
    fix = report.cri_fix(f)
    assert s.dropin in fix and "runtimes.runc" in fix and "defines only nvidia" in fix


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(not HAVE_CONTAINERD, reason="containerd not installed")
def test_debian_1_6_itself_refuses_to_load_cri_there(tmp_path: Path) -> None:
    """The rule checked against Debian's containerd 1.6 itself: started with Debian's config and
    nvidia-ctk 1.20's drop-in (recorded), its CRI plugin fails with the message detection gives."""
    import subprocess
    import time

    from tests.support import traces

    d = tmp_path / "c"
    (d / "conf.d").mkdir(parents=True)
    rec = "nvidia-toolkit/runtime-configure/debian-plain/etc/containerd/"
    main = traces.text(rec + "config.toml").replace('"/etc/containerd/conf.d/*.toml"', f'"{d}/conf.d/*.toml"')
    main = main.replace("version = 2", f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
                        f'[grpc]\n  address = "{d}/sock"\n[ttrpc]\n  address = "{d}/sock.ttrpc"\n', 1)  # fmt: skip
    (d / "config.toml").write_text(main)
    (d / "conf.d/99-nvidia.toml").write_text(traces.text(rec + "conf.d/99-nvidia.toml"))
    f = detect_node(str(d / "config.toml"))
    assert f.source == "config dump" and f.cri_error.startswith("no corresponding runtime configured")
    log = d / "containerd.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(["containerd", "--config", str(d / "config.toml")], stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "no corresponding runtime" not in log.read_text():
            assert p.poll() is None, log.read_text()[-2000:]
            time.sleep(0.2)
        text = log.read_text()
        # logrus escapes the quotes: `failed to load plugin io.containerd.grpc.v1.cri ... invalid plugin config: ...`
        assert "failed to load plugin io.containerd.grpc.v1.cri" in text, text[-3000:]
        assert "invalid plugin config: " + f.cri_error.replace('"', '\\"') in text, text[-3000:]
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_no_nvidia_runtime_and_empty_node(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "etc/containerd").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(BASE)
    f = detect_node("/etc/containerd/config.toml", root=str(host))
    assert f.node_type == "none" and f.nvidia_handler == "" and f.toolkit is None
    assert [h.name for h in f.handlers] == ["runc"]
    empty = detect_node("/etc/containerd/config.toml", root=str(tmp_path / "nothing"))
    assert empty.node_type == "none" and not empty.config_exists and empty.handlers == []
    assert "does not exist" in empty.source_note and empty.containerd_version == ""


def test_merge_rules_1x_replace_2x_merge(tmp_path: Path) -> None:
    """1.x: a later file's CRI section replaces the whole earlier one; 2.x merges deeply."""
    host = tmp_path / "host"
    (host / "etc/containerd/conf.d").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text('imports = ["conf.d/*.toml"]\n' + BASE)  # relative: the file's dir
    (host / "etc/containerd/conf.d/50-extra.toml").write_text(
        "version = 2\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        'BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    )
    eff, order, _ = load_files(Root(str(host)), "/etc/containerd/config.toml", 1)
    assert order == ["/etc/containerd/config.toml", "/etc/containerd/conf.d/50-extra.toml"]
    rts = eff["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert list(rts) == ["nvidia"]  # runc and sandbox_image are gone (containerd #5837)
    assert "sandbox_image" not in eff["plugins"]["io.containerd.grpc.v1.cri"]
    eff2, _, _ = load_files(Root(str(host)), "/etc/containerd/config.toml", 2)
    rts2 = eff2["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert sorted(rts2) == ["nvidia", "runc"]
    if HAVE_CONTAINERD:  # containerd 1.6 itself agrees with our 1.x rule
        s = tmp_path / "real"
        (s / "conf.d").mkdir(parents=True)
        (s / "config.toml").write_text(f'imports = ["{s}/conf.d/*.toml"]\n' + BASE)
        shutil.copy(host / "etc/containerd/conf.d/50-extra.toml", s / "conf.d")
        f = detect_node(str(s / "config.toml"))
        assert f.source == "config dump" and f.handler("runc") is None and f.handler("nvidia") is not None


def test_root_resolves_symlinks_inside_the_root(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "opt/ctr").mkdir(parents=True)
    (host / "opt/ctr/config.toml").write_text(BASE)
    (host / "etc/containerd").mkdir(parents=True)
    os.symlink("/opt/ctr/config.toml", host / "etc/containerd/config.toml")  # absolute: the host's /opt
    r = Root(str(host))
    assert r.fs("/etc/containerd/config.toml") == str(host / "opt/ctr/config.toml")
    os.symlink("../../../../../../etc/passwd", host / "etc/up")
    assert r.fs("/etc/up") == str(host / "etc/passwd")  # `..` never leaves the root
    assert detect_node("/etc/containerd/config.toml", root=str(host)).config_exists


def test_toolkit_config_overrides_and_bad_files(tmp_path: Path) -> None:
    s = ctrd.make_shape("n1-117", tmp_path / "host", "", base_text=BASE)
    (tmp_path / "host/etc/tk.toml").write_text('[nvidia-container-runtime]\nmode = "legacy"\n')
    f = detect_node(s.conf, root=str(s.root), toolkit_config="/etc/tk.toml")
    assert f.toolkit is not None and f.toolkit.path == "/etc/tk.toml" and f.node_type == "N1-legacy"
    s.fs(s.toolkit_config).write_text("mode = [unclosed\n")
    f = detect_node(s.conf, root=str(s.root))
    assert f.toolkit is not None and "cannot parse" in f.toolkit.error
    s.fs(s.conf).write_text("version = = 2\n")
    with pytest.raises(DetectError, match="cannot parse"):
        detect_node(s.conf, root=str(s.root))
    s.fs(s.conf).write_text('version = "2"\n')
    with pytest.raises(DetectError, match="unsupported config version"):
        detect_node(s.conf, root=str(s.root))


def test_jit_cdi_explicit_and_yaml_specs(tmp_path: Path) -> None:
    s = ctrd.make_shape("n1-117", tmp_path / "host", "", base_text=BASE)
    s.fs(s.toolkit_config).write_text('[nvidia-container-runtime]\nmode = "jit-cdi"\n')
    s.write("/var/run/cdi/nvidia.yaml", "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n"
            "  containerEdits: {}\n- name: GPU-abc\n  containerEdits: {}\n- name: all\n")  # fmt: skip
    f = detect_node(s.conf, root=str(s.root))
    assert f.node_type == "N1-jit-cdi"
    assert [(c.kind, c.devices) for c in f.cdi_specs] == [("nvidia.com/gpu", ["0", "GPU-abc", "all"])]


# ---- containerd 1.6 / 2.x merge rules against their recorded `config dump` ------------------------


def _runtimes_of(doc: dict[str, object], plugin: str) -> tuple[str, dict[str, str]]:
    ctd = doc["plugins"][plugin]["containerd"]  # type: ignore[index]
    return str(ctd.get("default_runtime_name")), {
        n: str((t.get("options") or {}).get("BinaryName", "")) for n, t in ctd["runtimes"].items()
    }


def _tree(tmp: Path, main: str, dropin: str | None) -> Path:
    from tests.support import traces

    host = tmp / "host"
    (host / "etc/containerd/conf.d").mkdir(parents=True)
    (host / "etc/containerd/config.toml").write_text(traces.text(main))
    if dropin:
        (host / "etc/containerd/conf.d/99-nvidia.toml").write_text(traces.text(dropin))
    return host


@pytest.mark.parametrize(
    ("dropin", "dump"),
    [
        (None, "dump.main-only.toml"),
        ("conf.d-99-nvidia.version3.toml", "dump.main+version3-dropin.toml"),
        ("conf.d-99-nvidia.version2-syntax.toml", "dump.main+version2-syntax-dropin.toml"),
    ],
)
def test_2x_merge_matches_containerd_2_3_config_dump(dropin: str | None, dump: str, tmp_path: Path) -> None:
    """containerd 2.3.4 merges drop-ins key by key, and migrates a version 2 drop-in's
    `io.containerd.grpc.v1.cri` into `io.containerd.cri.v1.runtime` first: the files-based
    rules give the runtimes and default runtime its `config dump` printed."""
    import tomllib

    from tests.support import traces

    m = "containerd2/merge/"
    host = _tree(tmp_path, m + "main.config.toml", m + dropin if dropin else None)
    f = detect_node("/etc/containerd/config.toml", root=str(host))  # no binary under the root: files
    assert f.source == "files" and f.containerd_major == 2 and f.cri_plugin == "io.containerd.cri.v1.runtime"
    want_default, want = _runtimes_of(tomllib.loads(traces.text(m + dump)), "io.containerd.cri.v1.runtime")
    assert f.default_runtime == want_default
    assert {h.name: h.binary_name for h in f.handlers} == want
    assert f.cri_error == ""
    if dropin:
        assert f.nvidia_handler == "nvidia" and f.handler("runc") is not None  # merged, not replaced


def test_2x_default_config_version_4(tmp_path: Path) -> None:
    """`containerd config default` of 2.3.4 is version 4, CDI on by default."""
    host = _tree(tmp_path, "containerd2/config-default.containerd-2.3.4.toml", None)
    f = detect_node("/etc/containerd/config.toml", root=str(host))
    assert f.config_version == 4 and f.containerd_major == 2 and f.cri_plugin == "io.containerd.cri.v1.runtime"
    assert f.cdi_enabled and f.cdi_spec_dirs == ["/etc/cdi", "/var/run/cdi"]
    assert f.default_runtime == "runc" and [h.name for h in f.handlers] == ["runc"] and f.cri_error == ""


@pytest.mark.parametrize(
    ("main", "cwd_rule", "dump"),
    [
        ("main.config.absolute-glob.toml", True, "dump.absolute-glob.toml"),
        ("main.config.toml", True, "dump.relative-glob-from-cwd-slash.toml"),  # the daemon's cwd is /
        ("main.config.toml", False, "dump.relative-glob-from-config-dir.toml"),  # 1.7 / 2.x: the file's dir
    ],
)
def test_1x_merge_matches_containerd_1_6_config_dump(main: str, cwd_rule: bool, dump: str, tmp_path: Path) -> None:
    """containerd 1.6.20: a drop-in naming the CRI plugin replaces the whole CRI section (runc is
    gone), and a relative import is globbed from the working directory."""
    import tomllib

    from tests.support import traces

    c = "containerd2/contrast-containerd-1.6.20/"
    host = _tree(tmp_path, c + main, c + "conf.d-99-nvidia.toml")
    eff, _, _ = load_files(Root(str(host)), "/etc/containerd/config.toml", 1, cwd_rule)
    want_default, want = _runtimes_of(tomllib.loads(traces.text(c + dump)), "io.containerd.grpc.v1.cri")
    ctd = eff["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert ctd.get("default_runtime_name") == want_default
    assert {n: str(t.get("options", {}).get("BinaryName", "")) for n, t in ctd["runtimes"].items()} == want
