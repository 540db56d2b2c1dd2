"""The chart's DRA objects (dra.enabled): rendered by Helm's own engine, valid Kubernetes objects
(the client models; our model of validation.go for the DeviceClass), the values reach the
plugin's flags and the plugin accepts them."""

from __future__ import annotations

from typing import Any

import pytest

from dra_plugin.__main__ import build_parser, load
from tests.support import k8svalidate, resourcevalidation

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (make venv)")

from tests.support.helm import CHART, by_kind, render  # noqa: E402

DRA = {
    "devicePlugin": {"deviceSplitCount": 4},
    "dra": {"enabled": True, "deviceClass": {"extendedResourceName": "nvidia.com/gpu"}, "memoryStepMiB": 512},
}


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


def test_dra_is_the_node_agent_instead_of_the_device_plugin() -> None:
    """dra.enabled alone switches the node agent: no device-plugin DaemonSet, RBAC or RuntimeClass
    (CDI needs no handler); the init container installs the library only, and the uninstall hook
    runs on the DRA plugin's nodes."""
    objs = render(DRA)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not [n for n in names if n[1].endswith(("-device-plugin", "-device-plugin-reader"))], names
    assert by_kind(objs, "RuntimeClass") == []
    assert {("ServiceAccount", "k8s-vgpu-dra-plugin"), ("ClusterRole", "k8s-vgpu-dra-plugin")} <= names
    assert ("DaemonSet", "k8s-vgpu-monitor") in names  # the monitor serves both front ends
    ds = dra_daemonset(objs)
    [init] = ds["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["vgpu-node-setup", "install", "--library-only"]
    assert init["args"] == ["--host-root=/host", "--prefix=/usr/local/vgpu"]
    from node_setup.__main__ import build_parser as setup_parser
    from node_setup.__main__ import options

    opts = options(setup_parser().parse_args([*init["command"][1:], *init["args"]]))
    assert opts.library_only and opts.prefix == "/usr/local/vgpu" and opts.host_root == "/host"
    [un] = [o for o in by_kind(objs, "DaemonSet") if o["metadata"]["name"].endswith("-node-uninstall")]
    [un_init] = un["spec"]["template"]["spec"]["initContainers"]
    assert un_init["command"] == ["vgpu-node-setup", "uninstall"] and "--library-only" in un_init["args"]
    assert options(setup_parser().parse_args([*un_init["command"][1:], *un_init["args"]])).library_only
    # the device-plugin path is as it was without dra
    plain = render()
    assert [o for o in by_kind(plain, "DaemonSet") if o["metadata"]["name"].endswith("-device-plugin")]
    assert len(by_kind(plain, "RuntimeClass")) == 1


def test_notes_of_a_dra_release() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(DRA, name="k8s-vgpu", namespace="kube-system")["k8s-vgpu/templates/NOTES.txt"]
    assert "vgpu-dra-plugin" in notes and "runtimeClassName" not in notes and "restart containerd" not in notes
    assert "deviceClassName: gpu.vgpu.k8s.io" in notes and 'requests: {memory: 6Gi, cores: "30"}' in notes
    assert "nvidia.com/gpu: 1" in notes and "1/4" in notes
    assert "ds/k8s-vgpu-dra-plugin" in notes and "Metrics: http://<node>:9394/metrics" in notes


def test_values_reach_the_plugin_and_it_accepts_them(tmp_path: Any) -> None:
    ds = dra_daemonset(render(DRA))
    c = ds["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vgpu-dra-plugin"]
    args = [a for a in c["args"] if not a.startswith("--config=")]
    args.append(f"--config={tmp_path / 'none.toml'}")
    cfg, _ = load(build_parser().parse_args(args))
    assert (cfg.slicing.split_count, cfg.memory_step, cfg.driver_name) == (4, 512 << 20, "gpu.vgpu.k8s.io")
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


def test_raw_manifest_mirrors_the_chart_and_the_plugin_accepts_it(tmp_path: Any) -> None:
    """packaging/k8s/dra-plugin.yaml (for clusters without Helm): valid objects, the chart's RBAC
    and DeviceClass, a command line the plugin accepts."""
    from tests.support import k8svalidate as kv
    from tests.support.helm import ROOT

    objs = kv.load_all((ROOT / "packaging/k8s/dra-plugin.yaml").read_text())
    assert {f"{o['kind']}/{o['metadata']['name']}": kv.validate(o) for o in objs} == {
        f"{o['kind']}/{o['metadata']['name']}": [] for o in objs
    }
    [dc] = by_kind(objs, "DeviceClass")
    assert resourcevalidation.validate(dc) == []
    chart = render({"dra": {"enabled": True}})
    [chart_dc] = by_kind(chart, "DeviceClass")
    assert dc["spec"] == chart_dc["spec"]
    [role] = by_kind(objs, "ClusterRole")
    [chart_role] = [o for o in by_kind(chart, "ClusterRole") if o["metadata"]["name"].endswith("-dra-plugin")]
    assert role["rules"] == chart_role["rules"]
    [ds] = by_kind(objs, "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in c["args"] if not a.startswith("--config=")] + [f"--config={tmp_path / 'none.toml'}"]
    cfg, _ = load(build_parser().parse_args(args))
    assert cfg.cdi_dir == "/var/run/cdi" and cfg.kubelet_dir == "/var/lib/kubelet"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi", "/var/lib/vgpu"} <= mounts


def test_helm_test_hook_claims_its_slice_through_dra(tmp_path: Any) -> None:
    """With dra.enabled the `helm test` pod cannot use the RuntimeClass (not rendered): it claims
    gpumemMiB and gpucores through a ResourceClaimTemplate and expects the memory kube-scheduler
    consumes for that request (rounded up by the slice's requestPolicy: our model of
    consumable_capacity.go), and the chart's scheduler, if on, is not asked."""
    from dra_plugin import slices
    from dra_plugin.config import settings
    from sim import draallocator
    from tests.dra_plugin.conftest import gpus
    from vgpu import quantity

    objs = render({**DRA, "scheduler": {"enabled": True}})
    hooks = [o for o in objs if o["metadata"]["name"].endswith("-test-slice")]
    [tmpl] = by_kind(hooks, "ResourceClaimTemplate")
    [pod] = by_kind(hooks, "Pod")
    assert {f"{o['kind']}": k8svalidate.validate(o) for o in hooks} == {"ResourceClaimTemplate": [], "Pod": []}
    spec = pod["spec"]
    assert "runtimeClassName" not in spec and "schedulerName" not in spec
    assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": tmpl["metadata"]["name"]}]
    c = spec["containers"][0]
    assert c["resources"]["claims"] == [{"name": "gpu"}] and "nvidia.com/gpu" not in c["resources"]["limits"]
    [req] = tmpl["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"]["deviceClassName"] == "gpu.vgpu.k8s.io"
    asked = req["exactly"]["capacity"]["requests"]
    assert asked == {"memory": "3000Mi", "cores": "10"}
    cfg = settings(None, memory_step=512 << 20, library_path=str(tmp_path / "lib.so"))  # DRA's memoryStepMiB
    [sl] = slices.build("node-1", gpus(1), cfg, generation=1)
    got = draallocator.consumed(asked["memory"], sl["spec"]["devices"][0]["capacity"]["memory"])
    want_mib = quantity.value(got) >> 20
    assert want_mib == 3328  # 256 Mi + 6 x 512 Mi: rounded up, not the 3000 asked
    assert f"--expect-memory-mib={want_mib}" in c["command"], (got, c["command"])
