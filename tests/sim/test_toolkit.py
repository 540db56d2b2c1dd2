"""The simulated NVIDIA container toolkit (sim/fakegpu/toolkit): device selection as the real
runtime does it (in-process, over the library the programs import), and the programs themselves
over real bundles with the distribution's runc: legacy and cdi mode, the accept-* flags, `all`,
unknown CDI names, our own prestart hooks kept ahead of NVIDIA's, the GPU Operator wrappers."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from sim.fakegpu import toolkit as tk
from sim.fakegpu.harness import FakeGPU

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fgtoolkit", ROOT / "sim/fakegpu/toolkit/fgtoolkit.py")
assert _spec and _spec.loader
fgt: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fgt)

LIB_DIR = "/usr/local/nvidia/lib64"  # the host's /usr/lib is bind-mounted read-only into the rootfs
U1 = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
U2 = "GPU-aaaaaaaa-0000-4000-8000-000000000002"


def cfg(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = fgt.load_config("/nonexistent/config.toml")
    c.update(over)
    return c


def spec_with(
    env: list[str] | None = None, ann: dict[str, str] | None = None, mounts: list[str] | None = None
) -> dict[str, Any]:
    return {
        "process": {"env": ["PATH=/bin", *(env or [])], "capabilities": {"bounding": ["CAP_KILL"]}},
        "annotations": dict(ann or {}),
        "mounts": [
            {"destination": f"{tk.VOLUME_ROOT}/{m}", "source": "/dev/null", "type": "bind"} for m in mounts or []
        ],
    }


# ---- selection (cuda_image.go order), in-process ------------------------------------------


def requested(s: dict[str, Any], c: dict[str, Any], *, annotations: bool) -> list[str]:
    """What the runtime (cdi mode: annotation prefixes kept) or the legacy hook / other modes
    (prefixes cleared) takes from the spec: CUDA.VisibleDevices."""
    prefixes = c["annotation_prefixes"] if annotations else []
    return list(fgt.Image(s, c, fgt.Logger(), annotation_prefixes=prefixes).visible_devices())


def test_defaults_are_nvidias() -> None:
    c = cfg()
    assert c["accept_envvar_unprivileged"] is True and c["accept_volume_mounts"] is False
    assert c["mode"] == "auto" and c["runtimes"] == ["runc", "crun"]
    assert c["default_kind"] == "nvidia.com/gpu" and c["annotation_prefixes"] == ["cdi.k8s.io/"]
    assert c["spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert c["skip_mode_detection"] is False and c["log_level"] == "info"


def test_recorded_config_default_reads_as_nvidias_defaults() -> None:
    """`nvidia-ctk config default` 1.20 as recorded: the same values as the built-in defaults."""
    from tests.support import traces

    c = fgt.load_config(str(traces.path("nvidia-toolkit/nvidia-ctk-config-default.toml")))
    d = cfg()
    for k in ("accept_envvar_unprivileged", "accept_volume_mounts", "mode", "runtimes", "default_kind",
              "annotation_prefixes", "spec_dirs", "skip_mode_detection", "log_level"):  # fmt: skip
        assert c[k] == d[k], k
    op = fgt.load_config(
        str(
            traces.path(
                "nvidia-toolkit/installer/cdi/usr/local/nvidia/toolkit/.config/nvidia-container-runtime/config.toml"
            )
        )
    )
    assert op["mode"] == "cdi" and op["skip_mode_detection"] is True  # only the installer sets it


def test_config_file_lookup_order() -> None:
    assert fgt.config_file({"NVIDIA_CTK_CONFIG_FILE_PATH": "/a.toml", "XDG_CONFIG_HOME": "/x"}) == "/a.toml"
    assert fgt.config_file({"XDG_CONFIG_HOME": "/x"}) == "/x/nvidia-container-runtime/config.toml"
    assert fgt.config_file({}) == "/etc/nvidia-container-runtime/config.toml"


def test_annotations_first_then_mounts_then_env() -> None:
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0"], {"cdi.k8s.io/p_x": "nvidia.com/gpu=1,nvidia.com/gpu=2"}, [U1])
    c = cfg(accept_volume_mounts=True)
    assert requested(s, c, annotations=True) == ["nvidia.com/gpu=1", "nvidia.com/gpu=2"]
    assert requested(s, c, annotations=False) == [U1]  # outside cdi mode the prefixes are cleared
    assert requested(s, cfg(), annotations=False) == ["0"]  # mounts not accepted
    other = spec_with(["NVIDIA_VISIBLE_DEVICES=0"], {"example.com/x": "nvidia.com/gpu=1"})
    assert requested(other, c, annotations=True) == ["0"]
    assert requested(other, cfg(annotation_prefixes=["example.com/"]), annotations=True) == ["nvidia.com/gpu=1"]
    # annotation values are split at commas as they are (cdiDeviceRequestsFromAnnotations)
    odd = spec_with(ann={"cdi.k8s.io/b": "nvidia.com/gpu=1, nvidia.com/gpu=2", "cdi.k8s.io/a": "x=y"})
    assert requested(odd, c, annotations=True) == ["x=y", "nvidia.com/gpu=1", " nvidia.com/gpu=2"]


def test_volume_mount_forms() -> None:
    s = spec_with(mounts=[U1, "cdi/nvidia.com/gpu/0", "cdi/nvidia.com/gpu=1", "imex/3", "cdi/bad"])
    s["mounts"].append({"destination": f"{tk.VOLUME_ROOT}/{U2}", "source": "/etc/passwd"})  # not /dev/null
    s["mounts"].append({"destination": f"{tk.VOLUME_ROOT}all", "source": "/dev/null"})  # no `/` needed
    s["mounts"].append({"destination": f"{tk.VOLUME_ROOT}/{U1}/", "source": "/dev//null"})  # cleaned: seen
    img = fgt.Image(s, cfg(accept_volume_mounts=True), fgt.Logger(), annotation_prefixes=[])
    assert img.from_mounts() == [U1, "nvidia.com/gpu=0", "nvidia.com/gpu=1", "all"]


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (["NVIDIA_VISIBLE_DEVICES=all"], ["all"]),
        (["NVIDIA_VISIBLE_DEVICES=none"], [""]),  # none.List(): one empty id, "driver only"
        (["NVIDIA_VISIBLE_DEVICES=void"], []),
        (["NVIDIA_VISIBLE_DEVICES="], []),
        ([], []),
        (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=1, 0"], ["1", "0"]),  # the last one wins
        (["NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_VISIBLE_DEVICES={U1}"], [U1]),  # a CUDA image + the plugin
        ([f"NVIDIA_VISIBLE_DEVICES={U1},all"], ["all"]),
        ([f"NVIDIA_VISIBLE_DEVICES={U1},void,all"], []),  # requested["void"] first
        (["NVIDIA_VISIBLE_DEVICES=none,all"], [""]),  # the first special value decides
        (["CUDA_VERSION=12.4"], ["all"]),  # a legacy CUDA image
        (["CUDA_VERSION=12.4", "NVIDIA_REQUIRE_CUDA=cuda>=12"], []),
    ],
)
def test_env_semantics(env: list[str], want: list[str]) -> None:
    assert requested(spec_with(env), cfg(), annotations=True) == want


def test_env_entry_without_equals_is_an_error() -> None:
    with pytest.raises(fgt.ToolkitError, match="invalid environment variable: JUNK"):
        requested(spec_with(["JUNK"]), cfg(), annotations=True)


def test_swarm_resource_env_wins_when_configured() -> None:
    s = spec_with([f"NVIDIA_VISIBLE_DEVICES={U1}", f"DOCKER_RESOURCE_GPU={U2}"])
    assert requested(s, cfg(), annotations=False) == [U1]
    assert requested(s, cfg(swarm_resource="DOCKER_RESOURCE_GPU"), annotations=False) == [U2]


def test_unprivileged_env_needs_the_flag() -> None:
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0"])
    assert requested(s, cfg(accept_envvar_unprivileged=False), annotations=True) == []
    s["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    assert requested(s, cfg(accept_envvar_unprivileged=False), annotations=True) == ["0"]


def mode_of(s: dict[str, Any], c: dict[str, Any], forced: str | None = None) -> str:
    return fgt.runtime_image(s, c, forced, fgt.Logger())[0]


def test_auto_mode_is_jit_cdi_unless_every_request_is_a_cdi_name() -> None:
    """internal/info/auto.go: auto = cdi when every request is fully qualified, else the runtime's
    default, jit-cdi (NewRuntimeModeResolver)."""
    assert mode_of(spec_with(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]), cfg()) == "cdi"
    assert mode_of(spec_with(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0,1"]), cfg()) == "jit-cdi"
    assert mode_of(spec_with(ann={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), cfg()) == "cdi"
    assert mode_of(spec_with(["NVIDIA_VISIBLE_DEVICES=all"]), cfg()) == "jit-cdi"
    assert mode_of(spec_with(), cfg()) == "jit-cdi"
    assert mode_of(spec_with(ann={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), cfg(), "legacy") == "legacy"
    assert mode_of(spec_with(), cfg(mode="jit-cdi")) == "jit-cdi"
    with pytest.raises(fgt.ToolkitError, match='invalid mode "bogus"'):
        mode_of(spec_with(), cfg(mode="bogus"))


def test_cdi_names_are_validated_as_the_cdi_parser_does() -> None:
    for ok in ("nvidia.com/gpu=0", "nvidia.com/gpu=GPU-0cf1b5a4-fb54", "a.b/c_d=x:y",
               "k8s.device-plugin.nvidia.com/gpu=all"):  # fmt: skip
        assert fgt.qualified(ok), ok
    for bad in ("GPU-x", "nvidia.com/gpu", "nvidia.com=0", "/dev/x=y", "nvidia.com/gpu=-x", "1nv.com/gpu=0",
                "nvidia.com/gp u=0", "nvidia.com/gpu/x=0", "nvidia.com/gpu="):  # fmt: skip
        assert not fgt.qualified(bad), bad


def test_legacy_hook_refuses_outside_legacy_mode_unless_told_to_skip() -> None:
    """hook_config.go: assertModeIsLegacy, checked for GPU containers only; auto resolves with
    legacy as the default there; skip-mode-detection (set only by the operator's installer)."""
    gpu = spec_with([f"NVIDIA_VISIBLE_DEVICES={U1}"])
    assert fgt.hook_devices(gpu, cfg(mode="legacy")) == [U1]
    assert fgt.hook_devices(gpu, cfg(mode="auto")) == [U1]
    for mode in ("cdi", "jit-cdi"):
        with pytest.raises(fgt.ToolkitError) as e:
            fgt.hook_devices(gpu, cfg(mode=mode))
        assert str(e.value) == fgt.HOOK_MODE_ERROR
        assert fgt.hook_devices(gpu, cfg(mode=mode, skip_mode_detection=True)) == [U1]
    assert fgt.hook_devices(spec_with(), cfg(mode="cdi")) == []  # no GPU container: nothing checked
    # auto with only CDI names resolves to cdi: the hook refuses that too
    with pytest.raises(fgt.ToolkitError):
        fgt.hook_devices(spec_with(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]), cfg(mode="auto"))


def test_argv_parsing() -> None:
    assert fgt.has_create(["--root", "/r", "--log", "/l", "create", "--bundle", "/b", "id"])
    assert not fgt.has_create(["--bundle", "create", "start", "id"])  # a bundle named create
    assert not fgt.has_create(["start", "id"]) and not fgt.has_create(["run", "id"])
    assert fgt.bundle_dir(["create", "-b", "/b", "x"]) == "/b"
    assert fgt.bundle_dir(["create", "--bundle=/c", "x"]) == "/c"
    assert fgt.log_file(["--log", "/l.json", "create"]) == "/l.json"
    assert fgt.log_format(["--log-format", "json"]) == "json" and fgt.log_format([]) == "text"


def test_legacy_appends_once_after_ours() -> None:
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0"])
    ours = {"path": "/usr/bin/vgpu-hook", "args": ["vgpu-hook", "prestart"]}
    s["hooks"] = {"prestart": [ours]}
    assert fgt.modify(s, cfg(hook_path="/x/nvidia-container-runtime-hook"), "legacy") == "legacy"
    assert fgt.modify(s, cfg(hook_path="/x/nvidia-container-runtime-hook"), "legacy") == "legacy"
    assert s["hooks"]["prestart"] == [
        ours,
        {"path": "/x/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook", "prestart"]},
    ]


def test_cdi_mode_removes_only_nvidia_hooks_and_applies_edits(tmp_path: Path) -> None:
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir()
    (spec_dir / "x.json").write_text(
        json.dumps(
            {
                "cdiVersion": "0.5.0",
                "kind": "nvidia.com/gpu",
                "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void", "A=1"]},
                "devices": [
                    {
                        "name": "0",
                        "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/null"}]},
                    },
                    {
                        "name": "1",
                        "containerEdits": {
                            "mounts": [{"hostPath": "/etc/hostname", "containerPath": "/a/b/c"}],
                            "hooks": [{"hookName": "createContainer", "path": "/bin/true", "env": ["X=1"]}],
                        },
                    },
                ],
            }
        )
    )
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0,1"])
    s["mounts"] = [
        {"destination": "/proc", "source": "proc", "type": "proc"},
        {"destination": "/x/y/z/w", "source": "/tmp"},
    ]
    ours = {"path": "/usr/bin/vgpu-hook", "args": ["vgpu-hook"]}
    s["hooks"] = {
        "prestart": [{"path": "/usr/bin/nvidia-container-runtime-hook"}, ours, {"path": "/o/nvidia-container-toolkit"}]
    }
    assert fgt.modify(s, cfg(spec_dirs=[str(spec_dir)]), "cdi") == "cdi"
    assert s["hooks"]["prestart"] == [ours]
    assert s["hooks"]["createContainer"] == [{"path": "/bin/true", "env": ["X=1"]}]
    # CDI env edits are appended after the spec's own entries (runtime-tools addEnv)
    assert s["process"]["env"] == ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0,1", "NVIDIA_VISIBLE_DEVICES=void", "A=1"]
    [dev] = s["linux"]["devices"]
    assert dev == {"path": "/dev/nvidia0", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666}
    assert {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"} in s["linux"]["resources"]["devices"]
    assert [m["destination"] for m in s["mounts"]] == ["/proc", "/a/b/c", "/x/y/z/w"]  # sorted by depth
    bad = spec_with(["NVIDIA_VISIBLE_DEVICES=0,GPU-nope"])
    with pytest.raises(fgt.ToolkitError, match=r"unresolvable CDI devices nvidia.com/gpu=GPU-nope$"):
        fgt.modify(bad, cfg(spec_dirs=[str(spec_dir)]), "cdi")
    # `none` is a device name like any other in cdi mode (cdiDeviceRequestor: "" -> "none")
    with pytest.raises(fgt.ToolkitError, match=r"unresolvable CDI devices nvidia.com/gpu=none$"):
        fgt.modify(spec_with(["NVIDIA_VISIBLE_DEVICES=none"]), cfg(spec_dirs=[str(spec_dir)]), "cdi")
    # void: nothing requested, nothing changed
    quiet = spec_with(["NVIDIA_VISIBLE_DEVICES=void"])
    assert fgt.modify(quiet, cfg(spec_dirs=[str(spec_dir)]), "cdi") == "cdi" and "linux" not in quiet


def test_yaml_specs_are_read_and_other_files_skipped(tmp_path: Path) -> None:
    """The CDI cache reads `.json` and `.yaml` specs (spec-dirs.go); here the management spec the
    operator's installer 1.20 wrote (recorded YAML), whose `all` names /dev/nvidia0."""
    from tests.support import traces

    d = tmp_path / "cdi"
    d.mkdir()
    text = traces.text("nvidia-toolkit/installer/cdi/var/run/cdi/management.nvidia.com-gpu.yaml")
    (d / "management.nvidia.com-gpu.yaml").write_text(text.replace("/run/nvidia/driver/dev/", f"{tmp_path}/"))
    (d / "ignored.yml").write_text("kind: nvidia.com/gpu\ndevices: [{name: x}]\n")
    for name, minor in (("nvidia0", 0), ("nvidiactl", 255)):
        os.mknod(tmp_path / name, 0o20666, os.makedev(195, minor))
    reg = fgt.load_registry([str(d)], fgt.Logger())
    assert sorted(reg) == ["management.nvidia.com/gpu=all"]
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=all"])
    fgt.modify(s, cfg(spec_dirs=[str(d)], default_kind="management.nvidia.com/gpu"), "cdi")
    assert [x["path"] for x in s["linux"]["devices"]] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert s["process"]["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"


def test_jit_cdi_generates_the_requested_devices_and_ignores_annotations(tmp_path: Path) -> None:
    """jit-cdi: bare names become runtime.nvidia.com/gpu=<name>, a spec for exactly those is made
    from the (simulated) driver; CDI annotations are not read outside cdi mode."""
    fgconf = tmp_path / "fg.conf"
    fgconf.write_text(f"[device]\nuuid = {U1}\nminor_number = 0\n[device]\nuuid = {U2}\nminor_number = 1\n")
    c = cfg(mode="jit-cdi")
    c["fakegpu"] = dict(c["fakegpu"], config=str(fgconf))
    s = spec_with([f"NVIDIA_VISIBLE_DEVICES={U2}"], ann={"cdi.k8s.io/x": f"nvidia.com/gpu={U1}"})
    assert fgt.modify(s, c) == "jit-cdi"
    assert [d["path"] for d in s["linux"]["devices"]] == ["/dev/nvidia1", "/dev/nvidiactl"]
    assert s["process"]["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=none"])  # the driver only
    fgt.modify(s, c)
    assert [d["path"] for d in s["linux"]["devices"]] == ["/dev/nvidiactl"]
    with pytest.raises(fgt.ToolkitError, match="ERROR_NOT_FOUND"):
        fgt.modify(spec_with(["NVIDIA_VISIBLE_DEVICES=GPU-nope"]), c)
    with pytest.raises(fgt.ToolkitError, match=r"runtime\.nvidia\.com"):
        fgt.modify(spec_with([f"NVIDIA_VISIBLE_DEVICES=runtime.nvidia.com/gpu=0,nvidia.com/gpu={U1}"]), c)


@pytest.mark.parametrize("case", ["envvar", "envvar-cudaimg", "cdiann"])
@pytest.mark.parametrize("which", ["container", "sandbox"])
def test_replays_the_real_runtimes_edits(case: str, which: str, tmp_path: Path) -> None:
    """The recorded config.json before the real nvidia-container-runtime 1.20 (cdi mode, the
    recorded toolkit config and CDI spec from `nvidia-ctk cdi generate`) and after it: the
    stand-in makes exactly the same edits - env appended (`NVIDIA_VISIBLE_DEVICES=void` after the
    image's `all` and the plugin's UUID), device nodes, allow rules, mounts sorted, hooks."""
    from tests.support import traces

    drv = tmp_path / "driver"
    (drv / "dev").mkdir(parents=True)
    for name, minor in (("nvidiactl", 255), ("nvidia0", 0)):
        os.mknod(drv / "dev" / name, 0o20666, os.makedev(195, minor))  # the recording's driver root had these
    (tmp_path / "cdi").mkdir()
    spec_text = traces.text("nvidia-toolkit/cdi-spec/nvidia.com-gpu.json").replace("/run/nvidia/driver", str(drv))
    (tmp_path / "cdi" / "nvidia.com-gpu.json").write_text(spec_text)
    c = fgt.load_config(str(traces.path("nvidia-toolkit/runtime-edit/nvidia-container-runtime-config.toml")))
    assert c["mode"] == "cdi"
    c.update(spec_dirs=[str(tmp_path / "cdi")], debug="")
    before = traces.load_json(f"nvidia-toolkit/runtime-edit/{case}/{which}.before.config.json")
    after = traces.load_json(f"nvidia-toolkit/runtime-edit/{case}/{which}.after.config.json")
    log = fgt.Logger(c)
    fgt.modify(before, c, logger=log)
    assert json.loads(json.dumps(before).replace(str(drv), "/run/nvidia/driver")) == after
    want = "No devices requested; no modification required." if which == "sandbox" else (
        "Creating CDI modifier for devices: [nvidia.com/gpu=GPU-0cf1b5a4-fb54-4cf0-abc9-7ae0c47f0105]")  # fmt: skip
    assert ("debug", want) in log.lines
    assert want in traces.text("nvidia-toolkit/runtime-edit/nvidia-container-runtime.log")


def test_generated_spec(fakegpu: FakeGPU) -> None:
    spec = tk.generate_cdi_spec(fakegpu, kind="example.com/gpu", container_lib_dir="/opt/lib")
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "example.com/gpu"
    names = [d["name"] for d in spec["devices"]]
    assert names == sorted(["0", "1", *fakegpu.uuids, "all"])  # sorted by name, as nvidia-ctk cdi generate
    common = spec["containerEdits"]
    assert common["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"  # wrapper.go: GetCommonEdits appends it
    assert {m["containerPath"] for m in common["mounts"]} >= {"/opt/lib/libcuda.so.1", "/opt/lib/libnvidia-ml.so.1"}
    assert {m["hostPath"] for m in common["mounts"]} >= {str(fakegpu.state_path), str(fakegpu.lib_dir / "libcuda.so.1")}
    assert common["deviceNodes"] == [{"path": "/dev/nvidiactl", "hostPath": "/dev/null"}]
    assert spec["devices"][-1]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/dev/null"},
        {"path": "/dev/nvidia1", "hostPath": "/dev/null"},
    ]


def test_toolkit_config_is_nvidias_toml(tmp_path: Path) -> None:
    import tomllib

    p = tk.write_toolkit_config(tmp_path / "c.toml", mode="cdi", accept_volume_mounts=True, spec_dirs=[tmp_path])
    raw = tomllib.loads(p.read_text())
    assert raw["accept-nvidia-visible-devices-as-volume-mounts"] is True
    assert raw["nvidia-container-runtime"]["mode"] == "cdi"
    assert raw["nvidia-container-runtime"]["modes"]["cdi"]["spec-dirs"] == [str(tmp_path)]
    c = fgt.load_config(str(p))
    assert c["mode"] == "cdi" and c["accept_volume_mounts"] is True


# ---- the programs over real bundles with runc ---------------------------------------------

needs_runc = pytest.mark.skipif(
    shutil.which("runc") is None or not os.path.exists("/bin/busybox") or os.geteuid() != 0,
    reason="needs root and runc",
)


class Node:
    """Two simulated GPUs, a toolkit config and CDI spec dir, a runc root."""

    def __init__(self, base: Path, build: Path) -> None:
        self.base = base
        self.gpu = FakeGPU(base / "fakegpu", build, gpus=2, memory=8 << 30)
        self.gpu.configure(
            [{"uuid": U1, "minor_number": 0, "memory": 8 << 30}, {"uuid": U2, "minor_number": 1, "memory": 4 << 30}]
        )
        self.cdi = base / "cdi"
        tk.write_cdi_spec(self.cdi, self.gpu, container_lib_dir=LIB_DIR)
        self.runc_root = base / "runc"
        self.runc_root.mkdir()
        self.n = 0

    def config(self, **flags: Any) -> Path:
        flags.setdefault("container_lib_dir", LIB_DIR)
        flags.setdefault("spec_dirs", [self.cdi])
        return tk.write_toolkit_config(self.base / "config.toml", self.gpu, **flags)

    def bundle(
        self,
        script: str,
        env: list[str] | None = None,
        ann: dict[str, str] | None = None,
        mounts: list[dict[str, Any]] | None = None,
    ) -> Path:
        from tests.support import hook as support

        self.n += 1
        b = self.base / f"b{self.n}"
        rootfs = support.make_rootfs(b / "rootfs")
        for link in ("lib", "lib64"):
            (rootfs / link).symlink_to(f"usr/{link}")
        spec = support.base_spec()
        spec["process"].update(terminal=False, args=["/bin/sh", "-c", script])
        spec["process"]["env"] = ["PATH=/bin:/opt/fakegpu", f"LD_LIBRARY_PATH={LIB_DIR}", *(env or [])]
        spec["root"] = {"path": "rootfs", "readonly": False}
        ro = ["rbind", "ro", "nosuid", "nodev"]
        spec["mounts"] += [
            {"destination": d, "type": "bind", "source": d, "options": ro} for d in ("/usr/lib", "/usr/lib64")
        ]
        spec["mounts"].append(
            {"destination": "/opt/fakegpu/fakegpu-burn", "type": "bind", "source": self.gpu.burn, "options": ro}
        )
        spec["mounts"] += mounts or []
        spec["annotations"] = dict(ann or {})
        spec["hooks"] = {"prestart": [{"path": "/bin/sh", "args": ["sh", "-c", f"echo ours >> {b}/hooks.log"]}]}
        (b / "config.json").write_text(json.dumps(spec))
        return b

    def run(self, runtime: Path, bundle: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        """create through `runtime` (as containerd-shim calls it), start, wait; (rc, out, err)."""
        cid = f"tk-{os.getpid()}-{self.n}"
        e = {**os.environ, "NVIDIA_CTK_CONFIG_FILE_PATH": str(self.base / "config.toml"), **(env or {})}
        for k in list(e):
            if k.startswith(("FAKEGPU_", "LD_")):
                del e[k]
        out, errf, log = bundle / "out", bundle / "err", bundle / "runc-log.json"
        try:
            with open(out, "w") as f, open(errf, "w") as ef:  # the container keeps runc's stdio
                c = subprocess.run(
                    [str(runtime), "--root", str(self.runc_root), "--log", str(log), "--log-format", "json",
                     "create", "--bundle", str(bundle), cid],
                    stdin=subprocess.DEVNULL, stdout=f, stderr=ef, env=e, timeout=60,
                )  # fmt: skip
            if c.returncode != 0:
                return c.returncode, "", errf.read_text() + (log.read_text() if log.exists() else "")
            s = subprocess.run(
                [str(runtime), "--root", str(self.runc_root), "start", cid],
                env=e,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert s.returncode == 0, s.stderr
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                st = subprocess.run(
                    ["runc", "--root", str(self.runc_root), "state", cid], capture_output=True, text=True
                )
                if st.returncode != 0 or json.loads(st.stdout)["status"] == "stopped":
                    break
                time.sleep(0.05)
            return 0, out.read_text(), ""
        finally:
            subprocess.run(["runc", "--root", str(self.runc_root), "delete", "--force", cid], capture_output=True)


@pytest.fixture
def node(tmp_path: Path, build_dir: Path) -> Any:
    n = Node(tmp_path, build_dir)
    yield n
    n.gpu.close()


SHOW = (
    "ls /dev | grep nvidia; for d in 0 1; do fakegpu-burn --device $d --seconds 0; done; "
    "env | grep VISIBLE; ls /etc/fakegpu"
)


def burned(out: str) -> dict[int, str]:
    """device -> uuid of the fakegpu-burn runs that initialised CUDA."""
    res = {}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "uuid" in d:
                res[int(d["device"])] = d["uuid"]
    return res


@needs_runc
@pytest.mark.root
def test_legacy_env_selects_one_gpu_after_our_hook(node: Node) -> None:
    node.config(mode="legacy")
    b = node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U2}"])
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    pre = json.loads((b / "config.json").read_text())["hooks"]["prestart"]
    assert [h["path"] for h in pre] == ["/bin/sh", str(tk.BUILD / "nvidia-container-runtime-hook")]
    assert (b / "hooks.log").read_text() == "ours\n"
    assert "nvidia1" in out.split() and "nvidia0" not in out.split() and "nvidiactl" in out.split()
    assert burned(out) == {0: U2}  # the one visible GPU is device 0 in the container
    assert f"NVIDIA_VISIBLE_DEVICES={U2}" in out  # env untouched: a hook cannot change it
    assert "driver.env" in out


@needs_runc
@pytest.mark.root
def test_cdi_annotation_selects_and_sets_void(node: Node) -> None:
    node.config(mode="cdi")
    b = node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U2}"], ann={"cdi.k8s.io/vgpu_x": f"nvidia.com/gpu={U1}"})
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    spec = json.loads((b / "config.json").read_text())
    assert [h["path"] for h in spec["hooks"]["prestart"]] == ["/bin/sh"]
    assert [d["path"] for d in spec["linux"]["devices"]] == ["/dev/nvidiactl", "/dev/nvidia0"]
    assert burned(out) == {0: U1}
    assert "NVIDIA_VISIBLE_DEVICES=void" in out and "FAKEGPU_VISIBLE_DEVICES=/dev" in out


@needs_runc
@pytest.mark.root
def test_cdi_unknown_name_fails_create(node: Node) -> None:
    node.config(mode="cdi")
    b = node.bundle("true", env=["NVIDIA_VISIBLE_DEVICES=GPU-nope"])
    rc, _, err = node.run(tk.RUNTIME, b)
    assert rc != 0
    assert "unresolvable CDI devices nvidia.com/gpu=GPU-nope" in err
    # in runc's --log (JSON), where containerd reads the reason: the last `error` line
    errors = [json.loads(ln)["msg"] for ln in err.splitlines() if ln.startswith("{") and '"level":"error"' in ln]
    assert errors and errors[-1].endswith("unresolvable CDI devices nvidia.com/gpu=GPU-nope")


@needs_runc
@pytest.mark.root
def test_auto_mode_with_qualified_names_is_cdi_and_all_gives_both(node: Node) -> None:
    node.config()
    b = node.bundle(SHOW, env=["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=all"])
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    assert burned(out) == {0: U1, 1: U2}
    b = node.bundle(SHOW, env=["NVIDIA_VISIBLE_DEVICES=all"])  # auto -> jit-cdi (toolkit >= 1.18)
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    assert burned(out) == {0: U1, 1: U2}
    assert "NVIDIA_VISIBLE_DEVICES=void" in out  # the generated spec's edit, appended
    spec = json.loads((b / "config.json").read_text())
    env = spec["process"]["env"]
    assert env[-1] == "NVIDIA_VISIBLE_DEVICES=void" and "NVIDIA_VISIBLE_DEVICES=all" in env  # appended
    assert [h["path"] for h in spec["hooks"]["prestart"]] == ["/bin/sh"]  # no legacy hook


@needs_runc
@pytest.mark.root
def test_jit_cdi_cuda_image_env_then_the_plugins_uuid(node: Node) -> None:
    """A CUDA image's NVIDIA_VISIBLE_DEVICES=all, then the device plugin's UUID (containerd's
    order): auto (jit-cdi) gives the one GPU.  A CDI annotation is not read in jit-cdi mode, but
    in auto mode CDI names in annotations make the mode cdi (info/auto.go sees them)."""
    cuda_env = ["NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_VISIBLE_DEVICES={U2}"]
    node.config()
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=cuda_env))
    assert rc == 0, err
    assert burned(out) == {0: U2}
    ann = {"cdi.k8s.io/x": f"nvidia.com/gpu={U1}"}
    node.config(mode="jit-cdi")
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=cuda_env, ann=ann))
    assert rc == 0, err
    assert burned(out) == {0: U2}  # the annotation is ignored
    node.config()
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=cuda_env, ann=ann))
    assert rc == 0, err
    assert burned(out) == {0: U1}  # auto -> cdi: the annotation wins


@needs_runc
@pytest.mark.root
def test_debug_log_lines_are_not_a_failure(node: Node) -> None:
    """log-level debug: the runtime writes debug lines to runc's --log (JSON) and its `debug`
    file, none to stderr; the create succeeds and containerd finds no `error` line."""
    node.config(mode="cdi", log_level="debug", debug=node.base / "nvct.log")
    b = node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U1}"])
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    assert burned(out) == {0: U1}
    lines = [json.loads(ln) for ln in (b / "runc-log.json").read_text().splitlines() if ln.startswith("{")]
    mine = [ln for ln in lines if "Injecting devices using CDI" in ln["msg"]]
    assert mine and mine[0]["level"] == "debug"
    assert not [ln for ln in lines if ln["level"] == "error"]
    assert "Injecting" not in (b / "err").read_text()  # (the container shares that stderr)
    assert "Injecting devices using CDI" in (node.base / "nvct.log").read_text()


@needs_runc
@pytest.mark.root
def test_volume_mounts_only_when_accepted(node: Node) -> None:
    vm = [{"destination": f"{tk.VOLUME_ROOT}/{U2}", "type": "bind", "source": "/dev/null", "options": ["bind", "ro"]}]
    env = [f"NVIDIA_VISIBLE_DEVICES={tk.VOLUME_ROOT}"]
    node.config(mode="legacy", accept_volume_mounts=True, accept_envvar_unprivileged=False)
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=env, mounts=vm))
    assert rc == 0, err
    assert burned(out) == {0: U2}
    # Not accepted: the env value is the device list, and no GPU is called that.
    node.config(mode="legacy")
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=env, mounts=vm))
    assert rc != 0 and "unknown device" in err


@needs_runc
@pytest.mark.root
def test_unprivileged_env_refused_by_flag(node: Node) -> None:
    node.config(mode="legacy", accept_envvar_unprivileged=False)
    rc, out, err = node.run(tk.RUNTIME, node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U1}"]))
    assert rc == 0, err
    assert burned(out) == {} and "nvidia" not in out.split()


@needs_runc
@pytest.mark.root
def test_forced_modes_and_operator_wrappers(node: Node) -> None:
    # .legacy forces the runtime's mode (and drops the annotations), but its hook reads the same
    # config: mode cdi and skip-mode-detection false (nvidia-ctk config default) -> it refuses.
    node.config(mode="cdi")
    b = node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U1}"], ann={"cdi.k8s.io/x": f"nvidia.com/gpu={U2}"})
    rc, out, err = node.run(tk.RUNTIME_LEGACY, b)
    assert rc != 0 and "invoking the NVIDIA Container Runtime Hook directly" in err, err
    node.config(mode="cdi", skip_mode_detection=True)  # what the operator's installer writes
    b = node.bundle(SHOW, env=[f"NVIDIA_VISIBLE_DEVICES={U1}"], ann={"cdi.k8s.io/x": f"nvidia.com/gpu={U2}"})
    rc, out, err = node.run(tk.RUNTIME_LEGACY, b)
    assert rc == 0, err
    assert burned(out) == {0: U1}
    root = tk.operator_root(node.base / "op", node.gpu, mode="legacy", spec_dirs=[node.cdi], container_lib_dir=LIB_DIR)
    (node.base / "config.toml").unlink()  # only the wrapper's config exists now
    b = node.bundle(SHOW, ann={"cdi.k8s.io/x": f"nvidia.com/gpu={U2}"})
    rc, out, err = node.run(root / "nvidia-container-runtime.cdi", b, env={"NVIDIA_CTK_CONFIG_FILE_PATH": ""})
    assert rc == 0, err
    assert burned(out) == {0: U2}
    b = node.bundle(SHOW, env=["NVIDIA_VISIBLE_DEVICES=0"])
    rc, out, err = node.run(root / "nvidia-container-runtime", b, env={"NVIDIA_CTK_CONFIG_FILE_PATH": ""})
    assert rc == 0, err
    pre = json.loads((b / "config.json").read_text())["hooks"]["prestart"]
    assert pre[-1]["path"] == str(root / "nvidia-container-runtime-hook")
    assert burned(out) == {0: U1}


def test_null_sections_and_missing_state(tmp_path: Path) -> None:
    s: dict[str, Any] = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0"]}, "hooks": None, "linux": None}
    assert fgt.modify(s, cfg(hook_path="/h/nvidia-container-runtime-hook"), "legacy") == "legacy"
    assert s["hooks"]["prestart"][-1]["path"] == "/h/nvidia-container-runtime-hook"
    c = cfg()
    c["fakegpu"] = dict(c["fakegpu"], state=str(tmp_path / "absent.state"))
    with pytest.raises(fgt.ToolkitError, match=r"absent\.state does not exist"):
        fgt.legacy_edits(["0"], c)
