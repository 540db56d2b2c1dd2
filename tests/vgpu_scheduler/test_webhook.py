"""The mutating webhook over HTTPS (AdmissionReview v1): patches applied and re-validated, rejections."""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim.admission import admission_review, verify_admission_response
from sim.kubeapi import KubeAPI, apply_json_patch, pod_object
from tests.support import traces
from tests.support.http import post_ok
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import (
    MiB,
    Running,
    decision_of,
    gpu_node,
    running_scheduler,
    send_raw,
    start_process,
    stop_process,
)
from vgpu import scheduling as sc
from vgpu_scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "tls.crt", d / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=vgpu-scheduler.kube-system.svc",
            "-addext",
            "subjectAltName=DNS:vgpu-scheduler.kube-system.svc,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return {"cert_file": str(cert), "key_file": str(key)}


@pytest.fixture(scope="module")
def hook(tls: dict[str, str]) -> Iterator[Running]:
    with KubeAPI() as api:
        api.create("nodes", gpu_node("n1", n=4, mem_gib=80))
        api.create("nodes", gpu_node("n2", n=2, mem_gib=40))
        with running_scheduler(api, None, **tls) as s:
            yield s


@pytest.fixture(scope="module")
def refusing_hook(tls: dict[str, str]) -> Iterator[Running]:
    """The webhook with refuse_oversized (the chart's scheduler.webhook.refuseOversized: true)."""
    with KubeAPI() as api:
        api.create("nodes", gpu_node("n1", n=4, mem_gib=80))
        api.create("nodes", gpu_node("n2", n=2, mem_gib=40))
        with running_scheduler(api, SchedulerConfig(refuse_oversized=True), **tls) as s:
            yield s


def admit(s: Running, pod: dict[str, Any], tls: dict[str, str] | None = None, op: str = "CREATE") -> dict[str, Any]:
    ctx = ssl.create_default_context(cafile=(tls or {}).get("cert_file"))
    body = admission_review(pod, "default")  # as kube-apiserver sends it
    body["request"]["operation"] = op
    out = post_ok(s.url + "/webhook", body, context=ctx)
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]
    return out["response"]


def applied(pod: dict[str, Any], resp: dict[str, Any]) -> dict[str, Any]:
    assert resp["allowed"] is True
    if "patch" not in resp:
        return pod
    assert resp["patchType"] == "JSONPatch"
    return apply_json_patch(pod, json.loads(base64.b64decode(resp["patch"])))


def test_sets_scheduler_fills_gpu_count_and_revalidates(hook: Running, tls: dict[str, str]) -> None:
    pod = pod_object("p", [("a", {"nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "30"}), ("plain", {"cpu": "1"})])
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpumem": "8192", "nvidia.com/gpucores": "30"}}
    resp = admit(hook, pod, tls)
    out = applied(pod, resp)
    assert out["spec"]["schedulerName"] == "vgpu-scheduler"
    assert out["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpumem": "8192",
        "nvidia.com/gpucores": "30",
        "nvidia.com/gpu": "1",
        sc.RESOURCE_NODE_MEM: "8192",  # the node-level totals kube-scheduler counts (preemption)
        sc.RESOURCE_NODE_CORES: "30",
    }
    assert out["spec"]["containers"][0]["resources"]["requests"] == {
        sc.RESOURCE_NODE_MEM: "8192",
        sc.RESOURCE_NODE_CORES: "30",
    }
    assert out["spec"]["containers"][1] == pod["spec"]["containers"][1]
    again = admit(hook, out, tls)
    assert again["allowed"] is True and "patch" not in again  # idempotent: nothing left to change


def test_init_container_without_resources_block_and_default_scheduler(hook: Running, tls: dict[str, str]) -> None:
    pod = pod_object("p", [("a", {"nvidia.com/gpu": "1"})], init=[("i", {})], scheduler="default-scheduler")
    pod["spec"]["initContainers"][0]["resources"] = {"requests": {"nvidia.com/gpucores": "10"}}
    out = applied(pod, admit(hook, pod, tls))
    assert out["spec"]["schedulerName"] == "vgpu-scheduler"
    assert out["spec"]["initContainers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "1",
        sc.RESOURCE_NODE_CORES: "10",
    }
    assert "patch" not in admit(hook, out, tls)


def test_node_level_totals_as_the_api_server_stores_them(hook: Running, tls: dict[str, str]) -> None:
    """The container's totals over its GPUs, in the canonical form the API server stores (3 x 1000
    MiB = "3k", traces quantities/), replacing a wrong one and removing an unwanted one; a pod the
    API server defaulted (requests = limits) and stored gets no operation when reviewed again."""
    limits = {"nvidia.com/gpu": "3", "nvidia.com/gpumem": "1000", sc.RESOURCE_NODE_CORES: "7"}
    pod = pod_object("p", [("a", limits), ("b", {"nvidia.com/gpu": "1", sc.RESOURCE_NODE_MEM: "1"})])
    pod["spec"]["containers"][0]["resources"]["requests"] = dict(limits)
    out = applied(pod, admit(hook, pod, tls))
    a, b = (c["resources"] for c in out["spec"]["containers"])
    assert a["limits"][sc.RESOURCE_NODE_MEM] == a["requests"][sc.RESOURCE_NODE_MEM] == "3k"
    assert sc.RESOURCE_NODE_CORES not in a["limits"] and sc.RESOURCE_NODE_CORES not in a["requests"]
    assert sc.RESOURCE_NODE_MEM not in b["limits"]  # 1/K of a GPU not chosen yet: not counted in-tree
    assert "patch" not in admit(hook, out, tls)


def test_other_schedulers_and_plain_pods_are_left_alone(hook: Running, tls: dict[str, str]) -> None:
    pod = pod_object("p", [("a", {"nvidia.com/gpu": "1"})], scheduler="volcano")
    assert "patch" not in admit(hook, pod, tls)
    plain = pod_object("q", [("a", {"cpu": "1"})])
    resp = admit(hook, plain, tls)
    assert resp["allowed"] and "patch" not in resp
    assert admit(hook, pod_object("x", [("a", {"nvidia.com/gpu": "abc"})]), tls, op="UPDATE")["allowed"]


@pytest.mark.parametrize(
    ("limits", "annotations", "why"),
    [
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1", "nvidia.com/gpumem-percentage": "5"}, {}, "exclusive"),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "101"}, {}, "must be 1..100"),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "120"}, {}, "must be 0..100"),
        ({"nvidia.com/gpu": "1.5"}, {}, "not a whole number"),
        ({"nvidia.com/gpu": "0", "nvidia.com/gpumem": "100"}, {}, "nvidia.com/gpu=0 with memory"),
        ({"nvidia.com/gpu": "1"}, {sc.NODE_POLICY_ANNOTATION: "random"}, "must be one of binpack, spread"),
        ({"nvidia.com/gpu": "1"}, {"hami.io/gpu-scheduler-policy": "topology"}, "must be one of binpack, spread"),
        ({"nvidia.com/gpu": "1"}, {sc.NUMA_BIND_ANNOTATION: "maybe"}, "must be true or false"),
        ({"nvidia.com/gpu": "1"}, {"nvidia.com/use-gpuuuid": "GPU-1,,GPU-2"}, "comma list of non-empty items"),
        ({"nvidia.com/gpu": "1"}, {sc.NOUSE_GPUUUID_ANNOTATION: "GPU 1"}, "is not a GPU UUID"),
        ({"nvidia.com/gpu": "1"}, {sc.USE_GPUTYPE_ANNOTATION: ""}, "comma list of non-empty items"),
    ],
)
def test_rejected_with_why(
    hook: Running, tls: dict[str, str], limits: dict[str, str], annotations: dict[str, str], why: str
) -> None:
    resp = admit(hook, pod_object("p", [("a", limits)], annotations=annotations), tls)
    assert resp["allowed"] is False
    assert why in resp["status"]["message"], resp["status"]["message"]


OVERSIZED = [
    ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "90000"}, "90000 MiB per GPU asked; no GPU has more than 81920 MiB"),
    ({"nvidia.com/gpu": "5"}, "5 GPUs asked; no node offers more than 4"),
]


@pytest.mark.parametrize(("limits", "why"), OVERSIZED)
def test_sizes_no_gpu_has_today_are_admitted_by_default(
    hook: Running, tls: dict[str, str], limits: dict[str, str], why: str
) -> None:
    """More MiB than any GPU, more GPUs than any node: admitted and sent to the scheduler (they stay
    Pending with the extender's reason, where an autoscaler sees them)."""
    pod = pod_object("p", [("a", limits)])
    out = applied(pod, admit(hook, pod, tls))
    assert out["spec"]["schedulerName"] == "vgpu-scheduler"


@pytest.mark.parametrize(("limits", "why"), OVERSIZED)
def test_sizes_no_gpu_has_today_are_refused_when_asked_to(
    refusing_hook: Running, tls: dict[str, str], limits: dict[str, str], why: str
) -> None:
    resp = admit(refusing_hook, pod_object("p", [("a", limits)]), tls)
    assert resp["allowed"] is False
    assert why in resp["status"]["message"], resp["status"]["message"]
    assert "%" not in resp["status"]["message"]
    resp = admit(refusing_hook, pod_object("p", [("a", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1000"})]), tls)
    assert resp["allowed"] is True


def test_valid_annotations_in_both_spellings_pass(hook: Running, tls: dict[str, str]) -> None:
    ann = {
        sc.NODE_POLICY_ANNOTATION: "spread",
        "hami.io/gpu-scheduler-policy": "binpack",
        "nvidia.com/use-gputype": "A100,H100",
        sc.NOUSE_GPUTYPE_ANNOTATION: "T4",
        sc.USE_GPUUUID_ANNOTATION: "GPU-a,GPU-b",
        "nvidia.com/nouse-gpuuuid": "GPU-c",
        "nvidia.com/numa-bind": "true",
    }
    resp = admit(hook, pod_object("p", [("a", {"nvidia.com/gpu": "2"})], annotations=ann), tls)
    assert resp["allowed"] is True


def test_sizes_not_judged_while_no_node_offers_gpus(kubeapi: KubeAPI, tls: dict[str, str]) -> None:
    with running_scheduler(kubeapi, SchedulerConfig(scheduler_name="gpu-sched"), **tls) as s:
        pod = pod_object("p", [("a", {"nvidia.com/gpu": "16", "nvidia.com/gpumem": "900000"})])
        out = applied(pod, admit(s, pod, tls))
        assert out["spec"]["schedulerName"] == "gpu-sched"


def test_plain_http_client_cannot_talk_to_the_tls_port(hook: Running) -> None:
    with pytest.raises(Exception):  # noqa: B017 - any failure: the port speaks TLS only
        urllib.request.urlopen(hook.url.replace("https:", "http:") + "/healthz", timeout=5).read()


def test_cert_path_errors_are_clear(kubeapi: KubeAPI, tmp_path: Path) -> None:
    from vgpu_scheduler.server import Service, make_server

    with pytest.raises((OSError, ValueError)):
        make_server(
            Service(SchedulerConfig(), None), cert_file=str(tmp_path / "missing.crt"), key_file=str(tmp_path / "k")
        )


# --- the recorded requests of a real kube-apiserver, byte for byte, to the real process ---------

WEBHOOK_TRACES = [
    "webhook/a-one-container-gpu-gpumem-gpucores.json",
    "webhook/b-init-and-app-container-gpu.json",
    "webhook/c-no-gpu.json",
    "webhook/d-job-created-pod-generateName.json",
]


@pytest.fixture(scope="module")
def webhook_process(tls: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The chart's webhook container: `vgpu-scheduler --serve webhook` over TLS, one GPU node known."""
    with KubeAPI() as api:
        api.create("nodes", gpu_node("node-1", n=1, mem_gib=16))
        kc = api.write_kubeconfig(tmp_path_factory.mktemp("kc") / "kubeconfig")
        proc, port = start_process(
            kc, "--serve", "webhook", "--cert-file", tls["cert_file"], "--key-file", tls["key_file"]
        )
        try:
            ctx = ssl.create_default_context(cafile=tls["cert_file"])
            wait_for(lambda: send_raw(port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", ctx)[0] == 200, 30, "readyz")
            yield port
        finally:
            stop_process(proc)


@pytest.mark.parametrize("rel", WEBHOOK_TRACES)
def test_recorded_api_server_requests_get_the_answer_it_accepts(
    webhook_process: int, tls: dict[str, str], rel: str
) -> None:
    """kube-apiserver calls `POST /webhook?timeout=10s`; the answer must be
    what its VerifyAdmissionResponse accepts, for every recorded pod (url and service forms)."""
    ctx = ssl.create_default_context(cafile=tls["cert_file"])
    for record in traces.load_json(rel):
        assert record["request_line"] == "POST /webhook?timeout=10s HTTP/1.1"
        status, headers, data = send_raw(webhook_process, traces.request_bytes(record, newline=True), ctx)
        assert status == 200, data
        assert headers["content-type"] == "application/json"
        out = json.loads(data)
        req = record["body"]["request"]
        resp = verify_admission_response(req["uid"], out)  # kube-apiserver's own checks
        assert set(out) == {"apiVersion", "kind", "response"} and resp["uid"] == req["uid"]
        assert resp["allowed"] is True
        pod = req["object"]
        if rel.endswith("c-no-gpu.json"):
            assert set(resp) == {"uid", "allowed"}  # no patch, no patchType
            continue
        assert resp["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(resp["patch"]))
        # Every container already names nvidia.com/gpu (the API server copied limits into
        # requests; 3000 arrives as "3k"): the scheduler changes, and a container with a sized ask
        # gets its node-level totals (per-GPU MiB and percent times its GPUs) in limits and
        # requests, in the canonical form the API server stores.
        sized = {
            "gpu-a": {"vgpu.k8s.io~1gpumem-total": "3k", "vgpu.k8s.io~1gpucores-total": "30"},
            "gpu-job-d": {"vgpu.k8s.io~1gpumem-total": "4096"},
        }
        name = pod["metadata"].get("name") or pod["metadata"]["generateName"].rstrip("-")
        want = [
            {"op": "add", "path": f"/spec/containers/0/resources/{part}/{key}", "value": v}
            for part in ("limits", "requests")
            for key, v in sized.get(name, {}).items()
        ]
        assert sorted(ops[:-1], key=json.dumps) == sorted(want, key=json.dumps)
        assert ops[-1] == {"op": "replace", "path": "/spec/schedulerName", "value": "vgpu-scheduler"}
        if rel.endswith("generateName.json"):  # made by the Job controller: no name yet
            assert "name" not in req and "name" not in pod["metadata"] and pod["metadata"]["generateName"]


def test_the_extender_routes_on_the_path_too(kubeapi: KubeAPI, tmp_path: Path) -> None:
    """The recorded filter call of a real kube-scheduler (its Pod asks gpumem "3k") to the real
    process, at /filter with a query string: answered, and the 3k read as 3000 MiB."""
    [record] = [
        r
        for r in traces.load_json("extender/requests-nodecache-true.json")
        if r["scenario"] == "basic-a" and r["verb"] == "filter"
    ]
    kubeapi.create("nodes", gpu_node("node-1", n=1, mem_gib=16))
    pod = record["body"]["Pod"]
    kubeapi.create("pods", {"metadata": pod["metadata"], "spec": pod["spec"]})
    proc, port = start_process(kubeapi.write_kubeconfig(tmp_path / "kc"), "--serve", "extender")
    try:
        wait_for(lambda: send_raw(port, b"GET /readyz?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", None)[0] == 200, 30, "readyz")
        data = traces.request_bytes(record, newline=False)
        data = data.replace(b"POST /extender/filter HTTP/1.1", b"POST /filter?from=trace HTTP/1.1", 1)
        status, _, body = send_raw(port, data, None)
        assert status == 200, body
        out = json.loads(body)
        assert out["Error"] == "" and out["NodeNames"] == ["node-1"], out
        d = decision_of(kubeapi, "basic-a")
        assert d is None or d.containers[0].gpus[0].memory == 3000 * MiB
    finally:
        stop_process(proc)
