"""The chart's scheduler part (templates/scheduler-*.yaml, webhook-*.yaml): rendered with Helm's
own engine (as tests/packaging/test_helm.py), every object valid for the kubernetes client models,
the KubeSchedulerConfiguration decoded against the v1 schema, the containers' flags parsed by the
real `vgpu-scheduler` parser, and the cert Job's `python -m vgpu_scheduler.certgen` run against the API
stand-in: the certificate it stores serves TLS that verifies with the caBundle it wrote."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from sim.kubeapi import KubeAPI
from tests.support import traces
from tests.support.helm import ROOT, assert_valid, by_kind, render
from tests.support.helm import SCHEDULER_ON as ON
from vgpu_scheduler import certgen

pytestmark = pytest.mark.timeout(180)


# --- kubescheduler.config.k8s.io/v1 (kubernetes/kube-scheduler config/v1/types.go), the fields we use ---
class LeaderElection(msgspec.Struct, forbid_unknown_fields=True):
    leaderElect: bool
    resourceLock: str
    resourceName: str
    resourceNamespace: str
    leaseDuration: str  # metav1.Duration
    renewDeadline: str
    retryPeriod: str


class Profile(msgspec.Struct, forbid_unknown_fields=True):
    schedulerName: str
    percentageOfNodesToScore: int | None = None


class ManagedResource(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    ignoredByScheduler: bool


class Extender(msgspec.Struct, forbid_unknown_fields=True):
    urlPrefix: str
    filterVerb: str = ""
    preemptVerb: str = ""
    prioritizeVerb: str = ""
    weight: int = 0
    bindVerb: str = ""
    enableHTTPS: bool = False
    httpTimeout: str = ""
    nodeCacheCapable: bool = False
    managedResources: list[ManagedResource] = []
    ignorable: bool = False


class KubeSchedulerConfiguration(msgspec.Struct, forbid_unknown_fields=True):
    apiVersion: str
    kind: str
    leaderElection: LeaderElection
    profiles: list[Profile]
    extenders: list[Extender]


def one(objects: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    [o] = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(suffix)]
    return o


def certgen_jobs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in by_kind(objects, "Job") if o["metadata"]["name"].endswith("-certgen")]


def containers(dep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}


def test_off_by_default() -> None:
    objects = render()
    assert not [o for o in objects if "scheduler" in o["metadata"]["name"] or "webhook" in o["metadata"]["name"]]
    # The device plugin may read and annotate its node's pods (decisions) in every install.
    role = one(objects, "ClusterRole", "device-plugin")
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "patch"]} in role["rules"]
    # ... and write its node's node-level GPU totals (vgpu.k8s.io/gpumem-total, gpucores-total)
    assert {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]} in role["rules"]


def test_enabled_render_is_valid() -> None:
    objects = render(ON)
    assert_valid(objects)
    kinds = sorted(
        o["kind"] for o in objects if "scheduler" in o["metadata"]["name"] or "webhook" in o["metadata"]["name"]
    )
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "ServiceAccount", "ClusterRole", "Role", "RoleBinding", "RoleBinding"]
        + ["ClusterRoleBinding"] * 3
        + ["Service", "MutatingWebhookConfiguration"]
        + ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Job"]  # cert Job
    )


def test_kube_scheduler_configuration() -> None:
    objects = render(ON)
    cm = one(objects, "ConfigMap", "-scheduler")
    cfg = msgspec.convert(yaml.safe_load(cm["data"]["config.yaml"]), KubeSchedulerConfiguration)
    assert (cfg.apiVersion, cfg.kind) == ("kubescheduler.config.k8s.io/v1", "KubeSchedulerConfiguration")
    assert [p.schedulerName for p in cfg.profiles] == ["vgpu-scheduler"]
    # every feasible node reaches the extender (kube-scheduler's default samples 10 % at 5,000)
    assert [p.percentageOfNodesToScore for p in cfg.profiles] == [100]
    assert cfg.leaderElection.leaderElect and cfg.leaderElection.resourceNamespace == "kube-system"
    [ext] = cfg.extenders
    assert (ext.filterVerb, ext.prioritizeVerb, ext.bindVerb) == ("filter", "prioritize", "bind")
    assert ext.preemptVerb == "preempt"  # victims that free a GPU, none that do not
    assert ext.nodeCacheCapable and not ext.enableHTTPS and not ext.ignorable
    assert ext.urlPrefix == "http://127.0.0.1:8090" and ext.httpTimeout == "30s"
    assert {m.name: m.ignoredByScheduler for m in ext.managedResources} == {
        "nvidia.com/gpu": False,  # vGPU slots are node allocatable: kube-scheduler counts them too
        "vgpu.k8s.io/gpumem-total": False,  # node-level totals: a pod short of them reaches preemption
        "vgpu.k8s.io/gpucores-total": False,
        "nvidia.com/gpumem": True,
        "nvidia.com/gpumem-percentage": True,
        "nvidia.com/gpucores": True,
    }
    # the same extender fields, spelled as the configuration kube-scheduler v1.36 ran with (K2)
    real = yaml.safe_load(traces.text("extender/kube-scheduler-config-nodecache-true.yaml"))["extenders"][0]
    ours = yaml.safe_load(cm["data"]["config.yaml"])["extenders"][0]
    assert set(real) - {"urlPrefix"} <= set(ours)
    assert {k: ours[k] for k in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb", "nodeCacheCapable")} == {
        k: real[k] for k in ("filterVerb", "prioritizeVerb", "bindVerb", "preemptVerb", "nodeCacheCapable")
    }
    dep = one(objects, "Deployment", "-scheduler")
    c = containers(dep)
    assert "--config=/etc/vgpu-scheduler/config.yaml" in c["kube-scheduler"]["command"]
    [vol] = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # the extender listens where kube-scheduler calls it
    assert "--bind=127.0.0.1:8090" in c["vgpu-scheduler"]["args"]


def test_kube_scheduler_image_tag() -> None:
    objects = render({"scheduler": {"enabled": True, "kubeScheduler": {"imageTag": "v1.31.2"}}})
    image = containers(one(objects, "Deployment", "-scheduler"))["kube-scheduler"]["image"]
    assert image == "registry.k8s.io/kube-scheduler:v1.31.2"
    image = containers(one(render(ON), "Deployment", "-scheduler"))["kube-scheduler"]["image"]
    tag = image.rpartition(":")[2]
    assert tag.startswith("v1.") and "+" not in tag  # the cluster's version


def test_flags_parse_with_the_real_parser() -> None:
    from vgpu_scheduler.__main__ import config_from, parser

    objects = render(
        {
            "scheduler": {
                "enabled": True,
                "nodePolicy": "spread",
                "gpuPolicy": "binpack",
                "defaultGpumemMiB": 2048,
                "defaultGpucores": 20,
                "overwriteDefaultScheduler": False,
                "name": "my-vgpu",
            }
        },
        namespace="gpu-system",
    )
    c = containers(one(objects, "Deployment", "-scheduler"))
    ext = parser().parse_args(c["vgpu-scheduler"]["args"])
    cfg = config_from(ext)
    assert (cfg.scheduler_name, cfg.node_policy, cfg.gpu_policy) == ("my-vgpu", "spread", "binpack")
    assert (cfg.default_gpumem_mib, cfg.default_gpucores, cfg.overwrite_default_scheduler) == (2048, 20, False)
    # Follow mode: the extender serves while kube-scheduler's own Lease (the one the
    # KubeSchedulerConfiguration names) is held by this pod's kube-scheduler; no Lease of its own.
    cm = one(objects, "ConfigMap", "-scheduler")
    kcfg = msgspec.convert(yaml.safe_load(cm["data"]["config.yaml"]), KubeSchedulerConfiguration)
    le = kcfg.leaderElection
    assert not cfg.leader_elect and cfg.serve == "extender"
    assert cfg.follow_lease == f"{le.resourceNamespace}/{le.resourceName}" and le.resourceNamespace == "gpu-system"
    # timings consistent: polled every retryPeriod, handover = leaseDuration - renewDeadline
    assert (le.leaseDuration, le.renewDeadline, le.retryPeriod) == ("15s", "10s", "2s")
    assert (cfg.retry_period_s, cfg.handover_s) == (2.0, 5.0)
    hook = parser().parse_args(c["vgpu-webhook"]["args"])
    wcfg = config_from(hook)
    assert (wcfg.scheduler_name, wcfg.default_gpumem_mib) == ("my-vgpu", 2048)  # same sizing rules
    assert hook.bind == "0.0.0.0:9443" and hook.cert_file.endswith("tls.crt")
    assert not wcfg.refuse_oversized  # default: oversized pods are admitted and stay Pending
    on = render({"scheduler": {"enabled": True, "webhook": {"refuseOversized": True}}})
    assert config_from(
        parser().parse_args(containers(one(on, "Deployment", "-scheduler"))["vgpu-webhook"]["args"])
    ).refuse_oversized
    # The webhook process serves /webhook only: no extender verbs on its port, no Lease.
    assert wcfg.serve == "webhook" and not wcfg.leader_elect and not wcfg.follow_lease
    role = one(objects, "Role", "-scheduler-leases")
    assert role["metadata"]["namespace"] == "gpu-system"
    assert yaml.safe_load(cm["data"]["config.yaml"])["profiles"] == [
        {"schedulerName": "my-vgpu", "percentageOfNodesToScore": 100}
    ]


def test_webhook_configuration() -> None:
    objects = render(ON)
    mwc = one(objects, "MutatingWebhookConfiguration")
    [wh] = mwc["webhooks"]
    assert wh["admissionReviewVersions"] == ["v1"] and wh["sideEffects"] == "None"
    # matchConditions send only vGPU pods, so Fail cannot block a pod that asks for no GPU.
    assert wh["failurePolicy"] == "Fail" and wh["timeoutSeconds"] == 10
    assert [c["name"] for c in wh["matchConditions"]] == ["asks-for-vgpu"]
    assert any(
        "CREATE" in r["operations"] and "pods" in r["resources"] and "" in r["apiGroups"] and "v1" in r["apiVersions"]
        for r in wh["rules"]
    )
    assert "caBundle" not in wh["clientConfig"]  # written by the cert Job
    svc_ref = wh["clientConfig"]["service"]
    svc = one(objects, "Service", "-webhook")
    assert (svc_ref["name"], svc_ref["namespace"], svc_ref["path"]) == (
        svc["metadata"]["name"],
        "kube-system",
        "/webhook",
    )
    assert svc_ref["port"] == svc["spec"]["ports"][0]["port"] == 443
    dep = one(objects, "Deployment", "-scheduler")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    port = containers(dep)["vgpu-webhook"]["ports"][0]
    assert port["name"] == svc["spec"]["ports"][0]["targetPort"] and port["containerPort"] == 9443
    exprs = wh["namespaceSelector"]["matchExpressions"]
    assert exprs == [{"key": "vgpu.k8s.io/webhook", "operator": "NotIn", "values": ["ignore"]}]
    # the TLS Secret the webhook mounts is the one the cert Job writes
    [tls] = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    job = one(objects, "Job", "-certgen")
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    args = certgen.parser().parse_args(cmd[3:])
    assert cmd[:3] == ["python3", "-m", "vgpu_scheduler.certgen"]
    assert (args.secret, args.webhook_config, args.service, args.namespace) == (
        tls["secret"]["secretName"],
        mwc["metadata"]["name"],
        svc["metadata"]["name"],
        "kube-system",
    )
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    sa = job["spec"]["template"]["spec"]["serviceAccountName"]
    [crb] = [o for o in by_kind(objects, "ClusterRoleBinding") if o["subjects"][0]["name"] == sa]
    cr = one(objects, "ClusterRole", crb["roleRef"]["name"])
    assert cr["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["mutatingwebhookconfigurations"],
            "resourceNames": [mwc["metadata"]["name"]],
            "verbs": ["get", "patch"],
        }
    ]


def test_webhook_off_and_cert_manager() -> None:
    objects = render({"scheduler": {"enabled": True, "webhook": {"enabled": False}}})
    assert not by_kind(objects, "MutatingWebhookConfiguration") and not certgen_jobs(objects)
    assert set(containers(one(objects, "Deployment", "-scheduler"))) == {"kube-scheduler", "vgpu-scheduler"}
    objects = render(
        {"scheduler": {"enabled": True, "webhook": {"certManager": {"enabled": True}, "failurePolicy": "Fail"}}}
    )
    assert_valid(objects)
    assert not certgen_jobs(objects)
    mwc = one(objects, "MutatingWebhookConfiguration")
    cert = one(objects, "Certificate")
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"kube-system/{cert['metadata']['name']}"
    assert mwc["webhooks"][0]["failurePolicy"] == "Fail"
    [tls] = [v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
    assert cert["spec"]["secretName"] == tls["secret"]["secretName"]
    assert cert["spec"]["issuerRef"]["name"] == one(objects, "Issuer")["metadata"]["name"]


def _condition(values: dict[str, Any] | None = None) -> str:
    [wh] = one(render(values or ON), "MutatingWebhookConfiguration")["webhooks"]
    [cond] = wh["matchConditions"]
    return str(cond["expression"])


def _matches(expression: str, obj: Any) -> bool:
    """The condition evaluated as kube-apiserver does for a webhook: `object` is the Pod's JSON
    (DynType, plugin/cel/compile.go), evaluated by a CEL implementation (cel-python); an error is
    an exception here (kube-apiserver would apply failurePolicy)."""
    import celpy

    env = celpy.Environment()
    out = env.program(env.compile(expression)).evaluate({"object": celpy.json_to_cel(obj)})
    if isinstance(out, celpy.CELEvalError):
        raise out
    assert isinstance(out, celpy.celtypes.BoolType)
    return bool(out)


def test_webhook_match_condition_on_the_recorded_pods() -> None:
    """The pods a real kube-apiserver sent its webhook (after defaulting): the three that ask for
    GPUs match, the one that asks for none does not, so it is never sent and never refused."""
    from tests.support import traces

    expr = _condition()
    for rel, want in [
        ("webhook/a-one-container-gpu-gpumem-gpucores.json", True),
        ("webhook/b-init-and-app-container-gpu.json", True),
        ("webhook/c-no-gpu.json", False),
        ("webhook/d-job-created-pod-generateName.json", True),
    ]:
        for record in traces.load_json(rel):
            assert _matches(expr, record["body"]["request"]["object"]) is want, rel
    init_only = {"spec": {"containers": [{"name": "a"}], "initContainers": [{"name": "i"}, {"name": "j"}]}}
    init_only["spec"]["initContainers"][1]["resources"] = {"limits": {"nvidia.com/gpucores": "10"}}
    for obj, want in [
        ({}, False),  # never an error: every field is tested with has() first
        ({"spec": {}}, False),
        ({"spec": {"containers": [{"name": "a", "resources": {}}]}}, False),
        ({"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}}}]}}, False),
        ({"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/mig-1g.5gb": "1"}}}]}}, False),
        ({"spec": {"containers": [{"name": "a", "resources": {"requests": {"nvidia.com/gpumem": "1k"}}}]}}, True),
        (
            {"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpumem-percentage": "5"}}}]}},
            True,
        ),
        (init_only, True),
    ]:
        assert _matches(expr, obj) is want, obj
    # The resource name of the release is the one matched (resourceName).
    other = _condition({"scheduler": {"enabled": True}, "resourceName": "example.com/vgpu"})
    assert _matches(other, {"spec": {"containers": [{"name": "a", "resources": {"limits": {"example.com/vgpu": 1}}}]}})
    assert not _matches(
        other, {"spec": {"containers": [{"name": "a", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    )


def test_webhook_condition_is_the_one_documented() -> None:
    text = (ROOT / "docs" / "operators" / "scheduling.md").read_text()
    assert f"```cel\n{_condition()}\n```" in text


def test_webhook_before_match_conditions() -> None:
    """Kubernetes < 1.28 has no matchConditions: every pod of the selected namespaces is sent, so the
    default is Ignore and the release namespace is left out (a Fail webhook could not restart)."""
    old = {"scheduler": {"enabled": True}, "kubeVersion": "v1.27.3"}
    [wh] = one(render(old), "MutatingWebhookConfiguration")["webhooks"]
    assert wh["failurePolicy"] == "Ignore" and "matchConditions" not in wh
    exprs = wh["namespaceSelector"]["matchExpressions"]
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]} in exprs
    old["scheduler"]["webhook"] = {"failurePolicy": "Fail"}
    [wh] = one(render(old), "MutatingWebhookConfiguration")["webhooks"]
    assert wh["failurePolicy"] == "Fail"  # the value wins
    ignore = {"scheduler": {"enabled": True, "webhook": {"failurePolicy": "Ignore"}}}
    [wh] = one(render(ignore), "MutatingWebhookConfiguration")["webhooks"]
    assert wh["failurePolicy"] == "Ignore" and wh["matchConditions"]
    image = containers(one(render(old), "Deployment", "-scheduler"))["kube-scheduler"]["image"]
    assert image.endswith(":v1.27.3")  # kubeVersion is the cluster's version for the whole chart


def test_scheduler_rbac() -> None:
    objects = render(ON)
    dep = one(objects, "Deployment", "-scheduler")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    bound = {
        o["roleRef"]["name"]
        for o in by_kind(objects, "ClusterRoleBinding") + by_kind(objects, "RoleBinding")
        if o["subjects"][0]["name"] == sa
    }
    assert {"system:kube-scheduler", "system:volume-scheduler", "extension-apiserver-authentication-reader"} <= bound
    role = one(objects, "ClusterRole", "-scheduler")
    rules = {(tuple(r["apiGroups"]), r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert {"list", "watch", "patch"} <= rules[(("",), "pods")]
    assert rules[(("",), "pods/binding")] == {"create"}
    assert {"list", "watch"} <= rules[(("",), "nodes")]
    leases = one(objects, "Role", "-scheduler-leases")
    assert leases["rules"][0] == {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}
    # get/list/watch (the extender follows it) and update (kube-scheduler renews it): that Lease only
    [named] = leases["rules"][1:]
    lease = yaml.safe_load(one(objects, "ConfigMap", "-scheduler")["data"]["config.yaml"])["leaderElection"]
    assert named["resourceNames"] == [lease["resourceName"]]
    assert {"get", "list", "watch", "update"} <= set(named["verbs"])


def test_replicas_and_lease_timings() -> None:
    from tests.support.helm import sdk as helm
    from vgpu_scheduler.__main__ import config_from, parser

    dep = one(render(ON), "Deployment", "-scheduler")
    assert dep["spec"]["replicas"] == 2  # safe: one serving extender, the leading kube-scheduler's
    [term] = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= labels.items()
    mine: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
    }
    dep = one(render({"scheduler": {"enabled": True, "affinity": mine}}), "Deployment", "-scheduler")
    assert dep["spec"]["template"]["spec"]["affinity"] == mine  # the user's affinity replaces ours
    objects = render(
        {
            "scheduler": {
                "enabled": True,
                "leaseDurationSeconds": 30,
                "renewDeadlineSeconds": 20,
                "retryPeriodSeconds": 4,
            }
        }
    )
    cm = one(objects, "ConfigMap", "-scheduler")
    le = yaml.safe_load(cm["data"]["config.yaml"])["leaderElection"]
    assert (le["leaseDuration"], le["renewDeadline"], le["retryPeriod"]) == ("30s", "20s", "4s")
    cfg = config_from(
        parser().parse_args(containers(one(objects, "Deployment", "-scheduler"))["vgpu-scheduler"]["args"])
    )
    assert (cfg.retry_period_s, cfg.handover_s) == (4.0, 10.0)
    # one replica without election: the extender always serves (no Lease to follow)
    objects = render({"scheduler": {"enabled": True, "replicas": 1, "leaderElect": False}})
    assert "affinity" not in one(objects, "Deployment", "-scheduler")["spec"]["template"]["spec"]
    cfg = config_from(
        parser().parse_args(containers(one(objects, "Deployment", "-scheduler"))["vgpu-scheduler"]["args"])
    )
    assert not cfg.follow_lease and not cfg.leader_elect
    with pytest.raises(helm.HelmError, match=r"needs scheduler\.leaderElect"):
        render({"scheduler": {"enabled": True, "replicas": 2, "leaderElect": False}})
    with pytest.raises(helm.HelmError, match="retryPeriodSeconds < renewDeadlineSeconds"):
        render({"scheduler": {"enabled": True, "renewDeadlineSeconds": 15}})


@pytest.mark.parametrize(
    "values",
    [
        {"scheduler": {"nodePolicy": "fast"}},
        {"scheduler": {"webhook": {"failurePolicy": "Maybe"}}},
        {"scheduler": {"defaultGpucores": 101}},
        {"scheduler": {"replicas": 0}},
        {"scheduler": {"retryPeriodSeconds": 0}},
        {"scheduler": {"httpTimeout": "30"}},
    ],
    ids=lambda v: json.dumps(v),
)
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    from tests.support.helm import sdk as helm

    with pytest.raises(helm.HelmError, match="at '/"):
        render(values)


def test_cert_job_against_the_api(tmp_path: Path) -> None:
    """The Job's own command, run against the API stand-in: Secret + caBundle, TLS verifies; idempotent."""
    objects = render(ON)
    mwc = one(objects, "MutatingWebhookConfiguration")
    cmd = one(objects, "Job", "-certgen")["spec"]["template"]["spec"]["containers"][0]["command"]
    with KubeAPI() as api:
        api.create("mutatingwebhookconfigurations", mwc, api_version="admissionregistration.k8s.io/v1")
        kc = api.write_kubeconfig(tmp_path / "kubeconfig")

        def job() -> str:
            r = subprocess.run(
                [sys.executable, *cmd[1:], f"--kubeconfig={kc}"], cwd=ROOT, capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0, r.stderr
            return r.stdout

        assert "created" in job()
        args = certgen.parser().parse_args(cmd[3:])
        secret = api.get("secrets", args.secret, "kube-system")
        assert secret["type"] == "kubernetes.io/tls"
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        ca_bundle = api.get("mutatingwebhookconfigurations", mwc["metadata"]["name"])["webhooks"][0]["clientConfig"]
        assert base64.b64decode(ca_bundle["caBundle"]).decode() == data["ca.crt"]
        for name in ("tls.crt", "tls.key", "ca.crt"):
            (tmp_path / name).write_text(data[name])
        _handshake(tmp_path, f"{args.service}.kube-system.svc")
        assert "kept" in job()  # helm upgrade: the certificate stays, caBundle is written again
        assert api.get("secrets", args.secret, "kube-system")["data"] == secret["data"]


def _handshake(d: Path, host: str) -> None:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "tls.crt", d / "tls.key")
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)

        def serve() -> None:
            conn, _ = ls.accept()
            with server.wrap_socket(conn, server_side=True) as s:
                s.sendall(b"ok")

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        verify = ssl.create_default_context(cafile=str(d / "ca.crt"))  # hostname checked too
        with socket.create_connection(ls.getsockname()) as raw, verify.wrap_socket(raw, server_hostname=host) as s:
            assert s.recv(2) == b"ok"
        t.join(5)
