"""Allocate for every `--device-list-strategy` through the kubelet stand-in (real gRPC over unix
sockets): env, volume mounts, CDI annotations, CDI devices, their combinations, the CDI kind and
annotation prefix, our token in every one; the flag and the config fields."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from device_plugin import strategy
from sim.kubelet import FakeKubelet
from tests.device_plugin.conftest import ROOT
from vgpu.config import ConfigError, load_config
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV, read_record

pytestmark = pytest.mark.timeout(120)
VOL = "/var/run/nvidia-container-devices"


def _admit(kubelet: FakeKubelet, inproc, count: int = 2, **cfg):  # type: ignore[no-untyped-def]
    p = inproc(device_split_count=2, **cfg)
    kubelet.wait_endpoint()
    a = kubelet.admit("default", "pod", "main", count=count)
    uuids = [d.rpartition("::")[0] for d in a.device_ids]
    token = a.envs[TOKEN_ENV]
    assert a.annotations[TOKEN_ANNOTATION] == token  # the hook finds the record by it
    assert [g.uuid for g in read_record(p.state.allocation_record(token)).gpus] == uuids
    return a, uuids, token


def test_envvar_is_the_default(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, token = _admit(kubelet, inproc)
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(uuids), TOKEN_ENV: token}
    assert a.annotations == {TOKEN_ANNOTATION: token} and a.mounts == [] and a.cdi_devices == []


def test_volume_mounts(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, token = _admit(kubelet, inproc, device_list_strategy=["volume-mounts"])
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": VOL, TOKEN_ENV: token}
    assert [(m.container_path, m.host_path, m.read_only) for m in a.mounts] == [
        (f"{VOL}/{u}", "/dev/null", True) for u in uuids
    ]
    assert a.cdi_devices == [] and a.annotations == {TOKEN_ANNOTATION: token}


def test_cdi_annotations(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, token = _admit(kubelet, inproc, device_list_strategy=["cdi-annotations"])
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": "void", TOKEN_ENV: token}  # all-CDI: the image's `all` is void
    [(key, value)] = [(k, v) for k, v in a.annotations.items() if k != TOKEN_ANNOTATION]
    assert re.fullmatch(r"cdi\.k8s\.io/vgpu-device-plugin_[0-9a-f]{16}", key)
    assert len(key.partition("/")[2]) <= 63
    assert value == ",".join(f"nvidia.com/gpu={u}" for u in uuids)
    assert a.mounts == [] and a.cdi_devices == []


def test_cdi_cri_with_kind(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, token = _admit(kubelet, inproc, count=1, device_list_strategy=["cdi-cri"], cdi_kind="example.com/vgpu")
    assert a.cdi_devices == [f"example.com/vgpu={uuids[0]}"]
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": "void", TOKEN_ENV: token}
    assert a.annotations == {TOKEN_ANNOTATION: token}


def test_combined_as_the_gpu_operator_sets_it(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, _token = _admit(
        kubelet,
        inproc,
        device_list_strategy=["cdi-annotations", "cdi-cri"],
        cdi_kind="management.nvidia.com/gpu",
        cdi_annotation_prefix="nvidia.cdi.k8s.io/",
    )
    names = [f"management.nvidia.com/gpu={u}" for u in uuids]
    assert a.cdi_devices == names
    [key] = [k for k in a.annotations if k != TOKEN_ANNOTATION]
    assert key.startswith("nvidia.cdi.k8s.io/vgpu-device-plugin_") and a.annotations[key] == ",".join(names)
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_envvar_and_volume_mounts_volume_wins(kubelet: FakeKubelet, inproc) -> None:
    a, uuids, _ = _admit(kubelet, inproc, count=1, device_list_strategy=["envvar", "volume-mounts", "cdi-cri"])
    assert a.envs["NVIDIA_VISIBLE_DEVICES"] == VOL  # as NVIDIA's plugin: the later assignment
    assert [m.container_path for m in a.mounts] == [f"{VOL}/{uuids[0]}"]
    assert a.cdi_devices == [f"nvidia.com/gpu={uuids[0]}"]


def test_the_hook_accepts_what_each_strategy_returns(kubelet: FakeKubelet, inproc) -> None:
    """The response, as containerd turns it into config.json, passes the hook's visibility check."""
    from runtime_hook import oci

    a, uuids, _token = _admit(
        kubelet, inproc, device_list_strategy=["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
    )
    spec = {
        "process": {"env": [f"{k}={v}" for k, v in a.envs.items()]},
        "mounts": [{"destination": m.container_path, "source": m.host_path} for m in a.mounts],
        "annotations": dict(a.annotations),
    }
    assert oci.gpu_requests_outside(spec, set(uuids)) == []
    assert oci.gpu_requests_outside(spec, {uuids[0]})  # the same response, a smaller record


def test_config_fields() -> None:
    c = load_config(None, {"device_plugin.device_list_strategy": ["cdi-cri", "envvar"]}).device_plugin
    assert c.device_list_strategy == ["cdi-cri", "envvar"]
    assert (c.cdi_kind, c.cdi_annotation_prefix) == ("nvidia.com/gpu", "cdi.k8s.io/")
    for field, value in (
        ("device_list_strategy", ["bogus"]),
        ("device_list_strategy", []),
        ("cdi_kind", "nvidia.com"),
        ("cdi_kind", "a/b=c"),
        ("cdi_annotation_prefix", "cdi.k8s.io"),
    ):
        with pytest.raises(ConfigError, match=f"device_plugin.{field}"):
            load_config(None, {f"device_plugin.{field}": value})
    assert strategy.parse_list(" envvar, cdi-cri ,") == ["envvar", "cdi-cri"]


def test_flag() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "device_plugin", "--config", "/nonexistent", "--device-list-strategy", "envvar,nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert r.returncode != 0
    assert "device_plugin.device_list_strategy" in r.stderr and "nope" in r.stderr
    assert "\n" not in r.stderr.strip()


@pytest.mark.parametrize("names", [["cdi-annotations"], ["cdi-cri"], ["cdi-annotations", "cdi-cri"]])
def test_cdi_only_voids_a_cuda_images_all(kubelet: FakeKubelet, inproc, names: list[str]) -> None:
    """An nvidia/cuda image's `NVIDIA_VISIBLE_DEVICES=all` comes first in config.json, the response's
    env after it (containerd CRI, traces containerd-cri/kubelet-pod-cuda-env-image.config.json): the
    value the runtime reads (the last) names no GPU, so only the CDI names select GPUs."""
    from runtime_hook import oci

    a, uuids, _token = _admit(kubelet, inproc, count=1, device_list_strategy=names)
    image_env = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"]
    spec = {
        "process": {"env": [*image_env, *(f"{k}={v}" for k, v in a.envs.items())]},
        "annotations": dict(a.annotations),
    }
    assert oci.gpu_requests_outside(spec, set(uuids)) == []
    spec["process"]["env"] = image_env  # without the response's void: the image's `all` is a request
    assert oci.gpu_requests_outside(spec, set(uuids))
