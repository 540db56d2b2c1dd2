"""The Helm chart renders with Helm's own engine (helm-python-sdk, Helm v4 SDK) and every object
it renders is a valid Kubernetes object (kubernetes client models); the values reach the objects.
The raw manifests in packaging/k8s/ are validated the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import k8svalidate
from tests.support.helm import CHART, ROOT, assert_valid, by_kind, container_args, daemonset, render
from tests.support.helm import sdk as helm


def test_lint_has_no_errors() -> None:
    result = helm.lint(str(CHART))
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # info only (e.g. "icon is recommended")


def test_default_render_is_valid_and_complete() -> None:
    objects = render()
    assert_valid(objects)
    hooks = [o for o in objects if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    objects = [o for o in objects if o not in hooks]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        ["DaemonSet", "DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "RuntimeClass", "Service"]
    )
    assert sorted(o["kind"] for o in hooks) == ["DaemonSet", "Job", "Pod", "Role", "RoleBinding", "ServiceAccount"]
    for ds in by_kind(objects, "DaemonSet"):
        spec = ds["spec"]
        pod = spec["template"]["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        assert pod["nodeSelector"] == {"gpu": "on"}  # the string "on", not YAML 1.1's true
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert ds["metadata"]["namespace"] == "kube-system"
    plugin = daemonset(objects, "device-plugin")
    [sa] = by_kind(objects, "ServiceAccount")
    assert plugin["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    [binding] = by_kind(objects, "ClusterRoleBinding")
    [role] = by_kind(objects, "ClusterRole")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kube-system"}
    ]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in role["rules"]
    args = container_args(plugin)
    for flag in (
        "--device-split-count=2",
        "--device-memory-scaling=1",
        "--device-cores-scaling=1",
        "--resource-name=nvidia.com/gpu",
    ):
        assert flag in args
    monitor = daemonset(objects, "monitor")
    assert monitor["spec"]["template"]["spec"]["hostPID"] is True
    assert "--policy=contended" in container_args(monitor) and "--metrics-port=9394" in container_args(monitor)
    [rc] = by_kind(objects, "RuntimeClass")
    assert rc["handler"] == "vgpu" and rc["metadata"]["name"] == "vgpu"
    [svc] = by_kind(objects, "Service")
    pod_labels = monitor["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"


def test_values_reach_the_daemons() -> None:
    objects = render(
        {
            "resourceName": "example.com/vgpu",
            "devicePlugin": {
                "deviceSplitCount": 10,
                "deviceMemoryScaling": 1.5,
                "deviceCoresScaling": 2,
                "migStrategy": "mixed",
            },
            "monitor": {
                "port": 9500,
                "policy": "strict",
                "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            },
            "nodeSelector": {"gpu": None, "accelerator": "nvidia"},  # null removes a default key (Helm)
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}],
        },
        name="vgpu",
        namespace="gpu-system",
    )
    assert_valid(objects)
    args = container_args(daemonset(objects, "device-plugin"))
    for flag in (
        "--device-split-count=10",
        "--device-memory-scaling=1.5",
        "--device-cores-scaling=2",
        "--resource-name=example.com/vgpu",
        "--mig-strategy=mixed",
    ):
        assert flag in args
    monitor = daemonset(objects, "monitor")
    assert "--policy=strict" in container_args(monitor) and "--metrics-port=9500" in container_args(monitor)
    assert monitor["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 9500
    for ds in (daemonset(objects, "device-plugin"), monitor):  # NVML lists MIG devices with the monitor capability
        env = {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        assert env.get("NVIDIA_MIG_MONITOR_DEVICES") == "all"
    dp = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert dp["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert "NVIDIA_MIG_CONFIG_DEVICES" not in {e["name"] for e in dp["env"]}
    for ds in by_kind(objects, "DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"accelerator": "nvidia"}
        assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}]
        assert ds["metadata"]["namespace"] == "gpu-system"
    [sm] = by_kind(objects, "ServiceMonitor")
    [svc] = by_kind(objects, "Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["gpu-system"]
    assert [e["port"] for e in sm["spec"]["endpoints"]] == [p["name"] for p in svc["spec"]["ports"]]
    assert svc["spec"]["ports"][0]["port"] == 9500


def test_dynamic_mig_gets_the_config_capability_and_none_no_sys_admin() -> None:
    """dynamic: NVIDIA_MIG_CONFIG_DEVICES=all (creating and destroying instances, NVIDIA's toolkit)
    with CAP_SYS_ADMIN; none: the capabilities dropped, nothing added."""
    objects = render({"devicePlugin": {"migStrategy": "dynamic"}})
    assert_valid(objects)
    dp = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert "--mig-strategy=dynamic" in dp["args"]
    assert {e["name"]: e.get("value") for e in dp["env"]}["NVIDIA_MIG_CONFIG_DEVICES"] == "all"
    assert dp["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    dp = daemonset(render({}), "device-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert dp["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_toggles() -> None:
    objects = render(
        {
            "runtimeClass": {"create": False},
            "monitor": {"enabled": False},
            "rbac": {"create": False},
            "serviceAccount": {"create": False},
        }
    )
    assert_valid(objects)
    objects = [o for o in objects if "helm.sh/hook" not in (o["metadata"].get("annotations") or {})]
    assert [o["kind"] for o in objects] == ["DaemonSet"]
    assert objects[0]["spec"]["template"]["spec"]["serviceAccountName"] == "default"


@pytest.mark.parametrize("path", sorted((ROOT / "packaging" / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_manifests_are_valid(path: Path) -> None:
    objects = k8svalidate.load_all(path.read_text())
    assert objects
    assert_valid(objects)


@pytest.mark.parametrize(
    "values",
    [
        {"monitor": {"policy": "fast"}},
        {"devicePlugin": {"deviceSplitCount": 0}},
        {"devicePlugin": {"migStrategy": "hybrid"}},
        {"devicePlugin": {"deviceSplitCount": "4"}},
        {"devicePlugin": {"deviceMemoryScaling": 0}},
        {"monitor": {"port": 70000}},
        {"resourceName": "gpu"},
        {"nodeSetup": {"prefix": "relative/path"}},
        {"nodeSetup": {"restartContainerd": "yes"}},
        {"nodeSetup": {"hostRoot": "/"}},
    ],
    ids=lambda v: str(v),
)
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    """values.schema.json: a typo in a value fails at install time, not in a crash-looping pod."""
    with pytest.raises(helm.HelmError, match="at '/"):
        render(values)


# ---- the node installer (vgpu-node-setup) and the image ---------------------------------------


def _build_image_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("vgpu_build_image", ROOT / "packaging/image/build.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_default_image_is_what_make_image_tags() -> None:
    from vgpu import __version__

    build = _build_image_module()
    tag = f"{build.DEFAULT_REPO}:{__version__}"
    assert "IMAGE_REPO ?= " + build.DEFAULT_REPO in (ROOT / "Makefile").read_text()
    objects = render()
    for ds in by_kind(objects, "DaemonSet") + by_kind(objects, "Job"):
        pod = ds["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"] == tag, (ds["metadata"]["name"], c["name"])
    built = ROOT / "build" / "image" / f"k8s-vgpu-{__version__}.json"
    if built.exists():  # the image of `make image` in this tree, when it has been built
        import json

        assert json.loads(built.read_text())["image"] == tag


def test_node_setup_init_container() -> None:
    objects = render()
    pod = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    assert init["command"] == ["vgpu-node-setup", "install"]
    assert init["args"] == [
        "--host-root=/host",
        "--prefix=/usr/local/vgpu",
        "--containerd-config=/etc/containerd/config.toml",
        "--handler=vgpu",
        "--state-dir=/var/lib/vgpu",
    ]
    assert init["securityContext"] == {"privileged": True}
    [mount] = init["volumeMounts"]
    vol = {v["name"]: v for v in pod["volumes"]}[mount["name"]]
    assert mount["mountPath"] == "/host" and vol["hostPath"] == {"path": "/", "type": "Directory"}
    assert "hostPID" not in pod  # only to restart containerd
    # The daemon container itself stays unprivileged.
    main = pod["containers"][0]["securityContext"]
    assert main["capabilities"] == {"drop": ["ALL"]} and main["allowPrivilegeEscalation"] is False
    assert not [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == mount["name"]]


def test_node_setup_values() -> None:
    objects = render(
        {
            "nodeSetup": {
                "restartContainerd": True,
                "prefix": "/opt/k8s-vgpu",
                "containerdConfig": "/etc/k3s/containerd/config.toml",
                "withoutNvidiaRuntime": True,
                "extraArgs": ["--python=/usr/bin/python3.11"],
            },
            "runtimeClass": {"handler": "vgpu-rt"},
        }
    )
    assert_valid(objects)
    pod = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    args = pod["initContainers"][0]["args"]
    for a in ("--prefix=/opt/k8s-vgpu", "--containerd-config=/etc/k3s/containerd/config.toml", "--handler=vgpu-rt",
              "--without-nvidia-runtime", "--python=/usr/bin/python3.11", "--restart-containerd"):  # fmt: skip
        assert a in args
    uninstall = daemonset(objects, "node-uninstall")["spec"]["template"]["spec"]
    assert uninstall["initContainers"][0]["command"] == ["vgpu-node-setup", "uninstall"]
    assert uninstall["initContainers"][0]["args"] == args  # the same host paths as install
    off = render({"nodeSetup": {"enabled": False}})
    assert "initContainers" not in daemonset(off, "device-plugin")["spec"]["template"]["spec"]
    assert not [o for o in off if "node-uninstall" in o["metadata"]["name"]]


def test_uninstall_hooks() -> None:
    objects = render()
    hooks = {
        f"{o['kind']}/{o['metadata']['name']}": o
        for o in objects
        if (o["metadata"].get("annotations") or {}).get("helm.sh/hook", "test") != "test"  # `helm test`: its own test
    }
    assert all(o["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete" for o in hooks.values())
    ds = hooks["DaemonSet/k8s-vgpu-node-uninstall"]
    job = hooks["Job/k8s-vgpu-node-uninstall-wait"]
    weight = {k: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for k, o in hooks.items()}
    assert weight["ServiceAccount/k8s-vgpu-node-uninstall"] < weight["DaemonSet/k8s-vgpu-node-uninstall"]
    assert weight["DaemonSet/k8s-vgpu-node-uninstall"] < weight["Job/k8s-vgpu-node-uninstall-wait"]
    plugin = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]
    pod = ds["spec"]["template"]["spec"]
    # Runs on the nodes the installer ran on.
    assert pod["nodeSelector"] == plugin["nodeSelector"] and pod["tolerations"] == plugin["tolerations"]
    assert pod["initContainers"][0]["args"] == plugin["initContainers"][0]["args"]
    assert pod["volumes"] == [{"name": "host-root", "hostPath": {"path": "/", "type": "Directory"}}]
    jpod = job["spec"]["template"]["spec"]
    assert jpod["containers"][0]["command"] == ["vgpu-node-setup", "wait-daemonset"]
    assert "--name=k8s-vgpu-node-uninstall" in jpod["containers"][0]["args"]
    [role] = [o for o in hooks.values() if o["kind"] == "Role"]
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["k8s-vgpu-node-uninstall"],
         "verbs": ["get"]}
    ]  # fmt: skip
    assert jpod["serviceAccountName"] == hooks["ServiceAccount/k8s-vgpu-node-uninstall"]["metadata"]["name"]


def test_notes_say_how_to_check() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render({}, name="k8s-vgpu", namespace="kube-system")["k8s-vgpu/templates/NOTES.txt"]
    assert "vgpuctl doctor" in notes and "kubectl -n kube-system exec" in notes
    assert "vgpuctl doctor --root /host" in notes and "nodeSetup.restartContainerd=true" in notes


def test_state_dir_reaches_the_hook(tmp_path: Path) -> None:
    """The chart's stateDir is where the device plugin writes allocation
    records; the hook that the node installer wires into containerd must read them there, whatever
    the host's /etc/vgpu/config.toml says. The init container's args, parsed by the real
    vgpu-node-setup parser, drive the real `vgpu-hook containerd print` against a host root."""
    import subprocess

    from node_setup import __main__ as node_setup_cli
    from node_setup import setup

    objects = render({"stateDir": "/srv/vgpu-state", "nodeSetup": {"withoutNvidiaRuntime": True}})
    dp = daemonset(objects, "device-plugin")["spec"]["template"]["spec"]
    assert "--state-dir=/srv/vgpu-state" in container_args({"spec": {"template": {"spec": dp}}})
    host = tmp_path / "host"
    for d in ("etc/vgpu", "etc/containerd", "usr/bin", "usr/local/vgpu/hook/current/runtime_hook"):
        (host / d).mkdir(parents=True)
    (host / "etc/vgpu/config.toml").write_text('[common]\nstate_dir = "/var/lib/vgpu"\n')  # the host's own
    (host / "etc/containerd/config.toml").write_text("version = 2\n")
    (host / "usr/bin/python3").touch()
    (host / "usr/local/vgpu/hook/current/runtime_hook/fastpath.py").touch()
    base = ROOT / "tests/data/real-traces/containerd-cri/ctr-oci-spec.containerd-1.6.20.json"  # `ctr oci spec`
    args = [*dp["initContainers"][0]["args"], f"--containerd-arg=--base-spec-source={base}"]
    a = node_setup_cli.build_parser().parse_args(["install", *args])
    opts = node_setup_cli.options(a)
    opts.host_root = str(host)
    r = subprocess.run(
        setup.containerd_argv(opts, "print", "/usr/bin/python3"), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert "VGPU_STATE=/srv/vgpu-state" in r.stdout and '"/srv/vgpu-state"' in r.stdout
    assert "/var/lib/vgpu" not in r.stdout
