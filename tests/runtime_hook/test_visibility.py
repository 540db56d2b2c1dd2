"""The hook's check that a container asks for no GPU outside its allocation record, in every
form NVIDIA's runtime or a CDI engine honours: NVIDIA_VISIBLE_DEVICES (uuids, CDI names, all,
none, void, the volume-mounts marker), /var/run/nvidia-container-devices/* mounts, cdi.k8s.io/*
annotations, device nodes already injected; hostile values refused with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from runtime_hook import oci, prestart
from tests.support import hook as support
from tests.support.hook import Node

A, B = support.UUID_A, support.UUID_B
ROOT = oci.VOLUME_DEVICES_ROOT


def spec(
    env: list[str] | None = None,
    mounts: list[str] | None = None,
    ann: dict[str, str] | None = None,
    nodes: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "process": {"env": ["PATH=/bin", *(env or [])]},
        "mounts": [{"destination": m, "source": "/dev/null", "type": "bind"} for m in mounts or []],
        "annotations": dict(ann or {}),
        "linux": {"devices": [{"path": n, "type": "c", "major": 195, "minor": 0} for n in nodes or []]},
    }


def outside(s: dict[str, Any], proc: str = "/nonexistent") -> list[str]:
    return oci.gpu_requests_outside(s, {A}, proc)


@pytest.mark.parametrize(
    "env",
    [
        [],
        [f"NVIDIA_VISIBLE_DEVICES={A}"],
        ["NVIDIA_VISIBLE_DEVICES=void"],  # what NVIDIA's CDI edits leave
        ["NVIDIA_VISIBLE_DEVICES=none"],
        ["NVIDIA_VISIBLE_DEVICES="],
        [f"NVIDIA_VISIBLE_DEVICES={ROOT}"],  # volume-mounts: the devices are the mounts
        [f"NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu={A}"],
        [f"NVIDIA_VISIBLE_DEVICES=management.nvidia.com/gpu={A}, {A}"],
    ],
)
def test_env_inside(env: list[str]) -> None:
    assert outside(spec(env)) == []


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("all", "all"),
        ("0", "0"),
        (f"{A},{B}", B),
        ("nvidia.com/gpu=all", "nvidia.com/gpu=all"),
        (f"nvidia.com/gpu={B}", f"nvidia.com/gpu={B}"),
        (f"{ROOT}/../x", f"{ROOT}/../x"),
        (f"=={A}", f"=={A}"),
    ],
)
def test_env_outside(value: str, named: str) -> None:
    [msg] = outside(spec([f"NVIDIA_VISIBLE_DEVICES={value}"]))
    assert msg == f"NVIDIA_VISIBLE_DEVICES names GPUs outside the vGPU allocation: {named}"


def test_the_last_env_occurrence_is_the_one_judged() -> None:
    """containerd writes the image's env, then the container's, duplicates kept; NVIDIA's runtime
    (image.WithEnv: a map) and the container's process act on the last one."""
    assert outside(spec(["NVIDIA_VISIBLE_DEVICES=all", f"NVIDIA_VISIBLE_DEVICES={A}"])) == []  # CUDA image
    assert outside(spec([f"NVIDIA_VISIBLE_DEVICES={A}", "NVIDIA_VISIBLE_DEVICES=void"])) == []  # after CDI edits
    [msg] = outside(spec([f"NVIDIA_VISIBLE_DEVICES={A}", "NVIDIA_VISIBLE_DEVICES=all"]))
    assert msg == "NVIDIA_VISIBLE_DEVICES names GPUs outside the vGPU allocation: all"
    [msg] = outside(spec([f"NVIDIA_VISIBLE_DEVICES={A}", f"NVIDIA_VISIBLE_DEVICES= {B} , {A}"]))
    assert msg.endswith(B)


def test_swarm_resource_env_is_checked_too() -> None:
    """DOCKER_RESOURCE_GPU (the toolkit's documented swarm-resource) wins over
    NVIDIA_VISIBLE_DEVICES where configured: the hook cannot know, so it is judged as well."""
    assert outside(spec([f"DOCKER_RESOURCE_GPU={A}"])) == []
    [msg] = outside(spec([f"NVIDIA_VISIBLE_DEVICES={A}", "DOCKER_RESOURCE_GPU=all"]))
    assert msg == "DOCKER_RESOURCE_GPU names GPUs outside the vGPU allocation: all"


def _trace_spec(rel: str) -> dict[str, Any]:
    from tests.support import traces

    data: dict[str, Any] = traces.load_json(rel)
    return data


# GPU named by the recording plugin's Allocate in the kubelet run, and by the CRI env in K6(d).
KUBELET_UUID = "GPU-8e1f0a9b-7c2d-4b3e-a5f6-3c4d5e6f7a02-0"
TOOLKIT_UUID = "GPU-0cf1b5a4-fb54-4cf0-abc9-7ae0c47f0105"


@pytest.mark.parametrize(
    ("rel", "uuid"),
    [
        # a real kubelet + containerd 1.6 pod from an image with nvidia/cuda's env
        ("containerd-cri/kubelet-pod-cuda-env-image.config.json", KUBELET_UUID),
        # config.json of the same kind before and after the real nvidia-container-runtime (cdi mode)
        ("nvidia-toolkit/runtime-edit/envvar-cudaimg/container.before.config.json", TOOLKIT_UUID),
        ("nvidia-toolkit/runtime-edit/envvar-cudaimg/container.after.config.json", TOOLKIT_UUID),
        ("nvidia-toolkit/runtime-edit/envvar/container.after.config.json", TOOLKIT_UUID),
        ("nvidia-toolkit/runtime-edit/cdiann/container.after.config.json", TOOLKIT_UUID),
    ],
)
def test_recorded_cuda_image_specs_pass_the_hook_check(rel: str, uuid: str) -> None:
    """The config.json files containerd and NVIDIA's runtime really wrote: the vGPU container of
    a CUDA image (NVIDIA_VISIBLE_DEVICES=all, then the plugin's UUID) is inside its allocation,
    and the same spec against an allocation of another GPU is refused, naming the GPU."""
    s = _trace_spec(rel)
    env = s["process"]["env"]
    assert oci.gpu_requests_outside(s, {uuid}, "/nonexistent") == []
    if env[-1] == "NVIDIA_VISIBLE_DEVICES=void":
        # after NVIDIA's CDI edits: the injected device node is what counts (next test)
        assert "/dev/nvidia0" in [d["path"] for d in s["linux"]["devices"]]
        return
    assert oci.gpu_requests_outside(s, {B}, "/nonexistent") == [
        f"NVIDIA_VISIBLE_DEVICES names GPUs outside the vGPU allocation: {uuid}"
    ]


def test_recorded_specs_device_nodes_against_the_driver(tmp_path: Path) -> None:
    """After the real runtime's CDI edits, the injected /dev/nvidia0 is mapped through the driver's
    /proc files: our GPU passes, another GPU's allocation is refused."""
    d = tmp_path / "0000:01:00.0"
    d.mkdir()
    (d / "information").write_text(f"GPU UUID: \t {TOOLKIT_UUID}\nDevice Minor: \t 0\n")
    s = _trace_spec("nvidia-toolkit/runtime-edit/envvar-cudaimg/container.after.config.json")
    assert oci.gpu_requests_outside(s, {TOOLKIT_UUID}, str(tmp_path)) == []
    assert oci.gpu_requests_outside(s, {B}, str(tmp_path)) == [
        "device nodes of GPUs outside the vGPU allocation: /dev/nvidia0"
    ]


def test_volume_mounts() -> None:
    assert (
        outside(spec(mounts=[f"{ROOT}/{A}", f"{ROOT}/cdi/nvidia.com/gpu/{A}", f"{ROOT}/cdi/nvidia.com/gpu={A}"])) == []
    )
    for dev in (B, "all", "0", f"cdi/nvidia.com/gpu/{B}", "cdi/nvidia.com/gpu=all"):
        [msg] = outside(spec(mounts=[f"{ROOT}/{dev}"]))
        assert msg == f"volume mount {ROOT}/{dev} names a GPU outside the vGPU allocation"


def test_volume_mount_prefix_matched_as_the_runtime_does() -> None:
    """requestsFromMounts (cuda_image.go@v1.20.0): HasPrefix(Clean(dst), root) with no `/` after
    the root, the device is the rest with `/` trimmed; `imex/` requests are channels, no GPU."""
    for dev in ("all", B):
        [msg] = outside(spec(mounts=[f"{ROOT}{dev}"]))
        assert msg == f"volume mount {ROOT}{dev} names a GPU outside the vGPU allocation"
    assert outside(spec(mounts=[f"{ROOT}{A}", ROOT, f"{ROOT}/imex/0"])) == []
    # cdi/<vendor>/<class>/<device>: SplitN(.., 3), the device keeps any further `/`
    [msg] = outside(spec(mounts=[f"{ROOT}/cdi/nvidia.com/gpu/{A}/x"]))
    assert "names a GPU outside" in msg


@pytest.mark.parametrize(
    "dst",
    [
        f"{ROOT}/../nvidia-container-devices/all",
        f"{ROOT}/{A}/../all",
        f"{ROOT}//all",
        f"{ROOT}/./{B}",
        f"/x/../{ROOT}/{A}",
    ],
)
def test_hostile_mount_paths(dst: str) -> None:
    [msg] = outside(spec(mounts=[dst]))
    assert "is not a plain device path" in msg or "outside the vGPU allocation" in msg
    assert "\n" not in msg


def test_cdi_annotations() -> None:
    ok = {"cdi.k8s.io/vgpu_1": f"nvidia.com/gpu={A}", "nvidia.cdi.k8s.io/container.main": f"nvidia.com/gpu={A}"}
    assert outside(spec(ann=ok)) == []
    assert outside(spec(ann={"example.com/x": "nvidia.com/gpu=all"})) == []  # not a CDI annotation
    for value in ("nvidia.com/gpu=all", f"nvidia.com/gpu={B}", "nvidia.com/gpu=0", A + ",all"):
        [msg] = outside(spec(ann={"cdi.k8s.io/x_y": value}))
        assert msg.startswith("annotation cdi.k8s.io/x_y names CDI devices outside the vGPU allocation: ")
    [msg] = outside(spec(ann={"nvidia.cdi.k8s.io/container.main": "management.nvidia.com/gpu=all"}))
    assert msg.endswith("management.nvidia.com/gpu=all")


def test_device_nodes_counted_without_the_driver() -> None:
    assert outside(spec(nodes=["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia3"])) == []
    [msg] = outside(spec(nodes=["/dev/nvidia0", "/dev/nvidia1"]))
    assert msg == "2 GPU device nodes for 1 allocated GPUs"


def test_device_nodes_mapped_with_the_driver(tmp_path: Path) -> None:
    for i, u in enumerate((A, B)):
        d = tmp_path / f"0000:{i:02x}:00.0"
        d.mkdir()
        (d / "information").write_text(f"Model: \t NVIDIA H100\nGPU UUID: \t {u}\nDevice Minor: \t {i}\n")
    assert outside(spec(nodes=["/dev/nvidia0"]), str(tmp_path)) == []
    [msg] = outside(spec(nodes=["/dev/nvidia1"]), str(tmp_path))
    assert msg == "device nodes of GPUs outside the vGPU allocation: /dev/nvidia1"
    [msg] = outside(spec(nodes=["/dev/nvidia7"]), str(tmp_path))  # no such GPU
    assert "/dev/nvidia7" in msg


def test_all_findings_in_one_line() -> None:
    s = spec([f"NVIDIA_VISIBLE_DEVICES={B}"], [f"{ROOT}/all"], {"cdi.k8s.io/a": "nvidia.com/gpu=all"})
    bad = outside(s)
    assert len(bad) == 3
    with pytest.raises(oci.HookError) as e:
        prestart.check_visible_devices(s, _record([A]))
    assert str(e.value) == "; ".join(bad) and "\n" not in str(e.value)


def _record(uuids: list[str]) -> Any:
    from vgpu import schemas

    return schemas.AllocationRecord(
        token="0" * 32,
        created=0.0,
        gpus=[schemas.AllocatedGPU(uuid=u, memory_limit=1 << 30, core_percent=50) for u in uuids],
    )


def test_garbage_never_raises() -> None:
    weird: list[Any] = [
        {"mounts": [None, 1, {"destination": 5}, {"destination": ROOT}], "annotations": {"cdi.k8s.io/x": 7}},
        {"linux": {"devices": [None, {"path": 3}, {"path": "/dev/nvidiaX"}]}, "annotations": []},
        {"mounts": {}, "linux": []},
    ]
    for s in weird:
        assert isinstance(oci.gpu_requests_outside(s, {A}), list)


# ---- through runc: the hook refuses the container with that line ----------------------------


@pytest.mark.root
@pytest.mark.parametrize("form", ["volume-mount", "hostile-mount", "annotation", "device-nodes"])
def test_refused_through_runc(node: Node, form: str) -> None:
    token = support.write_record(node.state)
    ann: dict[str, str] = {}
    if form == "annotation":
        ann = {"cdi.k8s.io/vgpu_x": "nvidia.com/gpu=all"}
    b = node.bundle(["echo", "STARTED"], env=[f"VGPU_ALLOCATION_TOKEN={token}"], annotations=ann)
    cfg = json.loads((b / "config.json").read_text())
    if form == "volume-mount":
        cfg["mounts"].append({"destination": f"{ROOT}/{B}", "type": "bind", "source": "/dev/null", "options": ["bind"]})
        expect = f"volume mount {ROOT}/{B} names a GPU outside the vGPU allocation"
    elif form == "hostile-mount":
        dst = f"{ROOT}/{A}/../all"
        cfg["mounts"].append({"destination": dst, "type": "bind", "source": "/dev/null", "options": ["bind"]})
        expect = "is not a plain device path"
    elif form == "annotation":
        expect = "names CDI devices outside the vGPU allocation: nvidia.com/gpu=all"
    else:
        cfg["linux"]["devices"] = [
            {"path": f"/dev/nvidia{i}", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666, "uid": 0, "gid": 0}
            for i in (0, 1)
        ]
        expect = "2 GPU device nodes for 1 allocated GPUs"
    (b / "config.json").write_text(json.dumps(cfg))
    r = node.run(b, f"vis-{form}")
    assert r.returncode != 0  # type: ignore[attr-defined]
    assert "STARTED" not in r.stdout  # type: ignore[attr-defined]
    assert expect in r.stderr, r.stderr  # type: ignore[attr-defined]
    assert node.containers() == []


@pytest.mark.root
def test_allowed_forms_start_through_runc(node: Node) -> None:
    token = support.write_record(node.state)
    env = [f"VGPU_ALLOCATION_TOKEN={token}", "NVIDIA_VISIBLE_DEVICES=void"]
    b = node.bundle(["echo", "STARTED"], env=env, annotations={"cdi.k8s.io/vgpu_x": f"nvidia.com/gpu={A}"})
    cfg = json.loads((b / "config.json").read_text())
    cfg["mounts"].append({"destination": f"{ROOT}/{A}", "type": "bind", "source": "/dev/null", "options": ["bind"]})
    (b / "config.json").write_text(json.dumps(cfg))
    r = node.run(b, "vis-ok")
    assert r.returncode == 0, r.stderr  # type: ignore[attr-defined]
    assert "STARTED" in r.stdout  # type: ignore[attr-defined]


def test_configured_cdi_prefix_is_checked() -> None:
    custom = {"gpus.example.com/x": "nvidia.com/gpu=all"}
    assert outside(spec(ann=custom)) == []  # not a prefix this node honours
    [msg] = oci.gpu_requests_outside(spec(ann=custom), {A}, "/nonexistent", ("cdi.k8s.io/", "gpus.example.com/"))
    assert msg.startswith("annotation gpus.example.com/x names CDI devices outside the vGPU allocation")


@pytest.mark.root
def test_configured_cdi_prefix_refused_through_runc(node: Node) -> None:
    """A non-default `device_plugin.cdi_annotation_prefix` (one NVIDIA's runtime is then set to
    honour) reaches the hook as `--cdi-annotation-prefix`, as `containerd install` writes it:
    annotations under it are checked too."""
    token = support.write_record(node.state)
    ann = {"gpus.example.com/vgpu_x": "nvidia.com/gpu=all"}
    b = node.bundle(["echo", "STARTED"], env=[f"VGPU_ALLOCATION_TOKEN={token}"], annotations=ann)
    cfg = json.loads((b / "config.json").read_text())
    for h in cfg["hooks"]["prestart"]:
        h["args"][-1:-1] = ["--cdi-annotation-prefix", "gpus.example.com/"]
    (b / "config.json").write_text(json.dumps(cfg))
    r = node.run(b, "vis-prefix")
    assert r.returncode != 0  # type: ignore[attr-defined]
    assert "STARTED" not in r.stdout  # type: ignore[attr-defined]
    assert "annotation gpus.example.com/vgpu_x names CDI devices outside" in r.stderr, r.stderr  # type: ignore[attr-defined]


def test_install_passes_a_configured_prefix(tmp_path: Path) -> None:
    from node_setup import hookcmd as cli
    from node_setup.hookspec import hook_args
    from runtime_hook import settings

    conf = tmp_path / "config.toml"
    conf.write_text('[device_plugin]\ncdi_annotation_prefix = "gpus.example.com/"\n')
    ns = cli.build_parser().parse_args(["--config", str(conf), "containerd", "print", "--without-nvidia-runtime"])
    args = hook_args(ns.config, cli.load_config(str(conf), {}))
    assert args[-2:] == ["--cdi-annotation-prefix", "gpus.example.com/"]
    assert "--cdi-annotation-prefix" not in hook_args(ns.config, cli.load_config(str(tmp_path / "none"), {}))
    with pytest.raises(ValueError, match="--cdi-annotation-prefix"):
        settings.FlagConfig({"--cdi-annotation-prefix": "../x/"})
