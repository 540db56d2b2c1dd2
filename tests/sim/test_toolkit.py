"""The simulated NVIDIA container toolkit (tests/fakegpu/toolkit): device selection as the real
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

from tests.fakegpu import toolkit as tk
from tests.fakegpu.harness import FakeGPU

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fgtoolkit", ROOT / "tests/fakegpu/toolkit/fgtoolkit.py")
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


def test_defaults_are_nvidias() -> None:
    c = cfg()
    assert c["accept_envvar_unprivileged"] is True and c["accept_volume_mounts"] is False
    assert c["mode"] == "auto" and c["runtimes"] == ["runc", "crun"]
    assert c["default_kind"] == "nvidia.com/gpu" and c["annotation_prefixes"] == ["cdi.k8s.io/"]
    assert c["spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]


def test_config_file_lookup_order() -> None:
    assert fgt.config_file({"NVIDIA_CTK_CONFIG_FILE_PATH": "/a.toml", "XDG_CONFIG_HOME": "/x"}) == "/a.toml"
    assert fgt.config_file({"XDG_CONFIG_HOME": "/x"}) == "/x/nvidia-container-runtime/config.toml"
    assert fgt.config_file({}) == "/etc/nvidia-container-runtime/config.toml"


def test_annotations_first_then_mounts_then_env() -> None:
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0"], {"cdi.k8s.io/p_x": "nvidia.com/gpu=1,nvidia.com/gpu=2"}, [U1])
    c = cfg(accept_volume_mounts=True)
    assert fgt.requested(s, c, annotations=True) == ["nvidia.com/gpu=1", "nvidia.com/gpu=2"]
    assert fgt.requested(s, c, annotations=False) == [U1]  # legacy mode clears the prefixes
    assert fgt.requested(s, cfg(), annotations=False) == ["0"]  # mounts not accepted
    other = spec_with(["NVIDIA_VISIBLE_DEVICES=0"], {"example.com/x": "nvidia.com/gpu=1"})
    assert fgt.requested(other, c, annotations=True) == ["0"]
    assert fgt.requested(other, cfg(annotation_prefixes=["example.com/"]), annotations=True) == ["nvidia.com/gpu=1"]


def test_volume_mount_forms() -> None:
    s = spec_with(mounts=[U1, "cdi/nvidia.com/gpu/0", "cdi/nvidia.com/gpu=1"])
    s["mounts"].append({"destination": f"{tk.VOLUME_ROOT}/{U2}", "source": "/etc/passwd"})  # not /dev/null
    assert fgt.from_mounts(s) == [U1, "nvidia.com/gpu=0", "nvidia.com/gpu=1"]


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (["NVIDIA_VISIBLE_DEVICES=all"], ["all"]),
        (["NVIDIA_VISIBLE_DEVICES=none"], ["none"]),
        (["NVIDIA_VISIBLE_DEVICES=void"], []),
        (["NVIDIA_VISIBLE_DEVICES="], []),
        ([], []),
        (["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_VISIBLE_DEVICES=1, 0"], ["1", "0"]),
        (["CUDA_VERSION=12.4"], ["all"]),  # a legacy CUDA image
        (["CUDA_VERSION=12.4", "NVIDIA_REQUIRE_CUDA=cuda>=12"], []),
    ],
)
def test_env_semantics(env: list[str], want: list[str]) -> None:
    assert fgt.requested(spec_with(env), cfg(), annotations=True) == want


def test_unprivileged_env_needs_the_flag() -> None:
    s = spec_with(["NVIDIA_VISIBLE_DEVICES=0"])
    assert fgt.requested(s, cfg(accept_envvar_unprivileged=False), annotations=True) == []
    s["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    assert fgt.requested(s, cfg(accept_envvar_unprivileged=False), annotations=True) == ["0"]


def test_auto_mode() -> None:
    assert fgt.resolve_mode(spec_with(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]), cfg(), None) == "cdi"
    assert fgt.resolve_mode(spec_with(["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0,1"]), cfg(), None) == "legacy"
    assert fgt.resolve_mode(spec_with(ann={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), cfg(), None) == "cdi"
    assert fgt.resolve_mode(spec_with(), cfg(), None) == "legacy"
    assert fgt.resolve_mode(spec_with(ann={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), cfg(), "legacy") == "legacy"
    with pytest.raises(fgt.ToolkitError, match="unsupported mode"):
        fgt.resolve_mode(spec_with(), cfg(mode="jit-cdi"), None)


def test_argv_parsing() -> None:
    assert fgt.has_create(["--root", "/r", "--log", "/l", "create", "--bundle", "/b", "id"])
    assert not fgt.has_create(["--bundle", "create", "start", "id"])  # a bundle named create
    assert not fgt.has_create(["start", "id"]) and not fgt.has_create(["run", "id"])
    assert fgt.bundle_dir(["create", "-b", "/b", "x"]) == "/b"
    assert fgt.bundle_dir(["create", "--bundle=/c", "x"]) == "/c"
    assert fgt.log_file(["--log", "/l.json", "create"]) == "/l.json"


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
    env = s["process"]["env"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in env and "NVIDIA_VISIBLE_DEVICES=0,1" not in env and "A=1" in env
    [dev] = s["linux"]["devices"]
    assert (dev["path"], dev["type"], dev["major"], dev["minor"]) == ("/dev/nvidia0", "c", 1, 3)
    assert {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"} in s["linux"]["resources"]["devices"]
    assert [m["destination"] for m in s["mounts"]] == ["/proc", "/a/b/c", "/x/y/z/w"]  # sorted by depth
    bad = spec_with(["NVIDIA_VISIBLE_DEVICES=0,GPU-nope"])
    with pytest.raises(fgt.ToolkitError, match=r"^unresolvable CDI devices nvidia.com/gpu=GPU-nope$"):
        fgt.modify(bad, cfg(spec_dirs=[str(spec_dir)]), "cdi")


def test_generated_spec(fakegpu: FakeGPU) -> None:
    spec = tk.generate_cdi_spec(fakegpu, kind="example.com/gpu", container_lib_dir="/opt/lib")
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "example.com/gpu"
    names = [d["name"] for d in spec["devices"]]
    assert names == [fakegpu.uuids[0], "0", fakegpu.uuids[1], "1", "all"]
    common = spec["containerEdits"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in common["env"]
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
        from tests.hook import support

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
    assert '"level": "error"' in err  # in runc's --log, where containerd reads the reason


@needs_runc
@pytest.mark.root
def test_auto_mode_with_qualified_names_is_cdi_and_all_gives_both(node: Node) -> None:
    node.config()
    b = node.bundle(SHOW, env=["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=all"])
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    assert burned(out) == {0: U1, 1: U2}
    b = node.bundle(SHOW, env=["NVIDIA_VISIBLE_DEVICES=all"])  # auto -> legacy
    rc, out, err = node.run(tk.RUNTIME, b)
    assert rc == 0, err
    assert burned(out) == {0: U1, 1: U2}
    assert "NVIDIA_VISIBLE_DEVICES=all" in out


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
    node.config(mode="cdi")  # .legacy ignores it, and the annotations with it
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
