"""The whole admission path as a real cluster runs it: the API stand-in (which calls webhooks as
kube-apiserver does: defaulting, canonical quantities, `POST /webhook?timeout=10s`, selectors,
matchConditions, failurePolicy, generateName after admission, validation) holds the chart's own
MutatingWebhookConfiguration (rendered by Helm) and calls the real `vgpu-scheduler --serve
webhook` process over TLS, with the certificate the chart's cert Job makes (vgpu_scheduler.certgen).

The pods are those of the recording (tests/data/real-traces/webhook/pods.yaml); what the stand-in
sends is compared with what the real API server sent. Then the webhook is stopped: a pod that
asks for no GPU is still created, a GPU pod is refused with the reason."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sim.kubeapi import KubeAPI
from tests.support import traces
from tests.support.http import post_json
from tests.support.poll import wait_for
from tests.vgpu_scheduler.helpers import gpu_node, send_raw, start_process, stop_process

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a dev dependency (make venv)")

NS = "kube-system"


def _render(values: dict[str, Any]) -> dict[str, Any]:
    from tests.support.helm import render

    [mwc] = [o for o in render(values, namespace=NS) if o["kind"] == "MutatingWebhookConfiguration"]
    return mwc


def _recorded_pods() -> dict[str, dict[str, Any]]:
    """pods.yaml of the recording: the three Pods, and the Job's template as the Job controller
    creates it (generateName, the ownerReference left out)."""
    out: dict[str, dict[str, Any]] = {}
    for doc in yaml.safe_load_all(traces.text("webhook/pods.yaml")):
        if doc["kind"] == "Pod":
            out[doc["metadata"]["name"]] = doc
        else:
            tmpl = doc["spec"]["template"]
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": doc["metadata"]["name"] + "-"}}
            pod["spec"] = tmpl["spec"]
            out["job"] = pod
    return out


def _post(api: KubeAPI, pod: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Create through the stand-in's HTTP API, as kubectl would."""
    return post_json(f"{api.url}/api/v1/namespaces/default/pods", pod, timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeAPI, Any, dict[str, Any]]]:
    from vgpu_scheduler import certgen

    d = tmp_path_factory.mktemp("admission")
    mwc = _render({"scheduler": {"enabled": True}})
    svc = mwc["webhooks"][0]["clientConfig"]["service"]
    tls = certgen.make(svc["name"], svc["namespace"])
    (d / "tls.crt").write_text(tls.cert_pem)
    (d / "tls.key").write_text(tls.key_pem)
    with KubeAPI() as api:
        api.create("nodes", gpu_node("node-1", n=1, mem_gib=16))
        proc, port = start_process(
            api.write_kubeconfig(d / "kubeconfig"),
            "--serve",
            "webhook",
            "--cert-file",
            str(d / "tls.crt"),
            "--key-file",
            str(d / "tls.key"),
        )
        try:
            import ssl

            ctx = ssl.create_default_context(cadata=tls.ca_pem)
            ctx.check_hostname = False
            wait_for(lambda: send_raw(port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n", ctx)[0] == 200, 30, "readyz")
            for hook in mwc["webhooks"]:
                hook["clientConfig"]["caBundle"] = base64.b64encode(tls.ca_pem.encode()).decode()
            api.create("mutatingwebhookconfigurations", mwc, api_version="admissionregistration.k8s.io/v1")
            api.endpoints.services[(svc["namespace"], svc["name"])] = ("127.0.0.1", port)
            yield api, proc, tls.__dict__
        finally:
            stop_process(proc)


def test_recorded_pods_through_the_chart_webhook(cluster: tuple[KubeAPI, Any, dict[str, Any]]) -> None:
    api, _, _ = cluster
    pods = _recorded_pods()
    api.admission_calls.clear()
    for key in ("gpu-a", "gpu-b", "nogpu-c", "job"):
        code, out = _post(api, pods[key])
        assert code == 201, out
    stored = {p["metadata"]["name"]: p for p in api.objects("pods", "default")}
    a = stored["gpu-a"]
    assert a["spec"]["schedulerName"] == "vgpu-scheduler"
    res = a["spec"]["containers"][0]["resources"]
    want = {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "3k"}  # as recorded
    # plus the node-level totals the webhook adds for kube-scheduler's own count (stored canonical)
    want |= {"vgpu.k8s.io/gpumem-total": "3k", "vgpu.k8s.io/gpucores-total": "30"}
    assert res == {"limits": want, "requests": want}
    assert stored["gpu-b"]["spec"]["schedulerName"] == "vgpu-scheduler"
    assert "schedulerName" not in stored["nogpu-c"]["spec"]  # never sent: the matchCondition is false
    [job] = [p for n, p in stored.items() if n.startswith("gpu-job-d-")]
    assert job["spec"]["schedulerName"] == "vgpu-scheduler"
    # What the stand-in sent, against what the real API server sent for the same pods.
    sent = {c["request"].get("name", "<generateName>"): c for c in api.admission_calls}
    assert sorted(sent) == ["<generateName>", "gpu-a", "gpu-b"]
    for name, rel in [
        ("gpu-a", "webhook/a-one-container-gpu-gpumem-gpucores.json"),
        ("gpu-b", "webhook/b-init-and-app-container-gpu.json"),
        ("<generateName>", "webhook/d-job-created-pod-generateName.json"),
    ]:
        real = traces.load_json(rel)[0]["body"]
        ours = sent[name]
        assert list(ours) == list(real) and list(ours["request"]) == list(real["request"])
        assert ours["request"]["object"]["metadata"].get("name") == real["request"]["object"]["metadata"].get("name")
        for key in ("initContainers", "containers"):
            got = [c.get("resources") for c in ours["request"]["object"]["spec"].get(key) or []]
            recorded = [c.get("resources") for c in real["request"]["object"]["spec"].get(key) or []]
            assert got == recorded, (name, key)


def test_webhook_down_blocks_gpu_pods_only(cluster: tuple[KubeAPI, Any, dict[str, Any]]) -> None:
    api, proc, _ = cluster
    stop_process(proc)  # the webhook is down (its port refuses connections)
    pods = _recorded_pods()
    plain = pods["nogpu-c"] | {"metadata": {"name": "nogpu-2"}}
    code, out = _post(api, plain)
    assert code == 201, out  # never sent: no outage can refuse it
    gpu = pods["gpu-a"] | {"metadata": {"name": "gpu-2"}}
    code, out = _post(api, gpu)
    assert code == 500 and 'failed calling webhook "pods.vgpu.k8s.io"' in out["message"], out
    assert [p["metadata"]["name"] for p in api.objects("pods", "default") if p["metadata"]["name"] == "gpu-2"] == []


def test_quantities_as_the_real_api_server(tmp_path: Path) -> None:
    """Every recorded quantity case, sent as the same JSON, gets the recorded answer from the
    stand-in: the status, the stored limits and requests or the exact 422 message, and what the
    mutating webhook was sent. As in the recording, the webhook allows everything (a recorder)."""
    import http.server
    import ssl
    import threading

    from vgpu_scheduler import certgen

    tls = certgen.make("vgpu-rec", "default")  # the recording's Service
    (tmp_path / "c").write_text(tls.cert_pem)
    (tmp_path / "k").write_text(tls.key_pem)
    seen: list[dict[str, Any]] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:
            review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(review["request"]["object"])
            out = json.dumps(
                {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                 "response": {"uid": review["request"]["uid"], "allowed": True}}
            ).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(tmp_path / "c"), str(tmp_path / "k"))
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    mwc = yaml.safe_load(traces.text("webhook/mutatingwebhookconfiguration.yaml").split("---")[-1])
    [hook] = [h for h in mwc["webhooks"] if "service" in h["clientConfig"]]
    hook["clientConfig"]["caBundle"] = base64.b64encode(tls.ca_pem.encode()).decode()
    mwc["webhooks"] = [hook]
    try:
        with KubeAPI() as api:
            api.create("mutatingwebhookconfigurations", mwc, api_version="admissionregistration.k8s.io/v1")
            api.endpoints.services[("default", "vgpu-rec")] = ("127.0.0.1", srv.server_address[1])
            for i, case in enumerate(traces.load_json("quantities/quantities.json")["cases"], 1):
                name = f"q-{i}"
                # The resources as the recording sent them (1000.0 stays a JSON number 1000.0).
                container = f'{{"name": "main", "image": "pause", "resources": {case["sent_resources_json"]}}}'
                body = f'{{"apiVersion": "v1", "kind": "Pod", "metadata": {{"name": "{name}"}}, '
                body += f'"spec": {{"containers": [{container}]}}}}'

                seen.clear()
                code, out = post_json(f"{api.url}/api/v1/namespaces/default/pods", body, timeout=30)
                assert code == case["http_status"], (case, out)
                [obj] = seen
                assert obj["spec"]["containers"][0]["resources"] == case["mutating_webhook_saw_resources"]
                if code == 201:
                    res = api.get("pods", name)["spec"]["containers"][0]["resources"]
                    assert res == {"limits": case["stored_limits"], "requests": case["stored_requests"]}
                else:
                    assert out["message"] == case["error"], out  # the recording named its pods q-1...
    finally:
        srv.shutdown()
        srv.server_close()
