"""The chart's DRA objects (dra.enabled): rendered by Helm's own engine, valid Kubernetes objects
(the client models; our model of validation.go for the DeviceClass), the values reach the
plugin's flags and the plugin accepts them."""

from __future__ import annotations

from typing import Any

import pytest

from device_plugin.dra.__main__ import build_parser, load
from tests.packaging import k8svalidate
from tests.support import resourcevalidation

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (make venv)")

from tests.packaging.test_helm import by_kind, render  # noqa: E402

DRA = {
    "devicePlugin": {"enabled": False, "deviceSplitCount": 4},
    "dra": {"enabled": True, "deviceClass": {"extendedResourceName": "nvidia.com/gpu"}, "memoryStepMiB": 512},
}


@pytest.fixture(autouse=True)
def _models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(k8svalidate.MODELS, ("resource.k8s.io/v1", "DeviceClass"), "V1DeviceClass")


def dra_daemonset(objs: list[dict[str, Any]]) -> dict[str, Any]:
    [ds] = [o for o in by_kind(objs, "DaemonSet") if o["metadata"]["name"].endswith("-dra-plugin")]
    return ds


def test_off_by_default() -> None:
    objs = render()
    assert by_kind(objs, "DeviceClass") == []
    assert not [o for o in objs if "dra-plugin" in o["metadata"]["name"]]


def test_dra_objects_are_valid(tmp_path: Any) -> None:
    objs = render(DRA)
    problems = {f"{o['kind']}/{o['metadata']['name']}": k8svalidate.validate(o) for o in objs}
    assert {k: v for k, v in problems.items() if v} == {}
    [dc] = by_kind(objs, "DeviceClass")
    assert resourcevalidation.validate(dc) == []
    assert dc["spec"] == {
        "selectors": [{"cel": {"expression": 'device.driver == "gpu.vgpu.k8s.io"'}}],
        "extendedResourceName": "nvidia.com/gpu",
    }
    assert not [o for o in by_kind(objs, "DaemonSet") if o["metadata"]["name"].endswith("-device-plugin")]
    [role] = [o for o in by_kind(objs, "ClusterRole") if o["metadata"]["name"].endswith("-dra-plugin")]
    rules = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert rules[("resource.k8s.io", "resourceclaims")] == {"get"}
    assert {"list", "create", "patch", "delete"} <= rules[("resource.k8s.io", "resourceslices")]


def test_values_reach_the_plugin_and_it_accepts_them(tmp_path: Any) -> None:
    ds = dra_daemonset(render(DRA))
    c = ds["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vgpu-dra-plugin"]
    args = [a for a in c["args"] if not a.startswith("--config=")]
    args.append(f"--config={tmp_path / 'none.toml'}")
    cfg, _ = load(build_parser().parse_args(args))
    assert (cfg.split_count, cfg.memory_step, cfg.driver_name) == (4, 512 << 20, "gpu.vgpu.k8s.io")
    assert cfg.library_path == "/usr/local/vgpu/lib/libvgpu.so" and cfg.cdi_dir == "/var/run/cdi"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi", "/var/lib/vgpu"} <= mounts


@pytest.mark.parametrize(
    "dra",
    [
        {"nvidiaCdiDevice": "serial"},
        {"driverName": "Bad_Name"},
        {"memoryStepMiB": 0},
        {"deviceClass": {"extendedResourceName": "gpu"}},
        {"unknown": 1},
    ],
)
def test_schema_rejects_bad_dra_values(dra: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError, match="at '/dra"):
        render({"dra": {"enabled": True, **dra}})
