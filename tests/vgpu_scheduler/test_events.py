"""Reasons read right in events: kube-scheduler uses the failure message as the *format* of the
FailedScheduling event (schedule_one.go handleSchedulingFailure, client-go's events recorder
fmt.Sprintf), so a `%` in an extender's reason becomes a Go verb ("20%!c(MISSING)ompute"). The
extender's reasons hold no `%`; the kube-scheduler stand-in formats events as Go does, checked
against Go's own fmt (tests/data/kube-scheduler-events/go-sprintf-no-operands.json, recorded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.kubeapi import KubeAPI
from sim.kubescheduler import NOTE_LENGTH_LIMIT, ExtenderConfig, KubeScheduler, go_sprintf, truncate_message
from tests.support.inventory import uuid
from tests.vgpu_scheduler.helpers import GiB, gpu_node, running_scheduler, vgpu_pod
from vgpu import scheduling as sc
from vgpu_scheduler.extender import ExtenderBindingResult, ExtenderFilterResult, readable
from vgpu_scheduler.snapshot import Use

DATA = Path(__file__).resolve().parents[1] / "data" / "kube-scheduler-events"


def test_the_stand_in_formats_as_go_does() -> None:
    rows = json.loads((DATA / "go-sprintf-no-operands.json").read_text())
    assert len(rows) > 400
    wrong = [
        (r["format"], r["sprintf"], go_sprintf(r["format"])) for r in rows if go_sprintf(r["format"]) != r["sprintf"]
    ]
    assert wrong == []
    assert go_sprintf("20% compute free < 25% asked") == "20%!c(MISSING)ompute free < 25%!a(MISSING)sked"


def test_truncated_as_kube_scheduler_truncates() -> None:
    long = "x" * 2000
    t = truncate_message(long)
    assert len(t.encode()) == NOTE_LENGTH_LIMIT and t.endswith("x ...")
    assert truncate_message("short") == "short"


def test_results_hold_no_percent() -> None:
    r = ExtenderFilterResult(FailedNodes={"n": "x: 50% free"}, FailedAndUnresolvableNodes={"m": "ok"}, Error="a%b")
    assert r.FailedNodes == {"n": "x: 50\uff05 free"} and r.FailedAndUnresolvableNodes == {"m": "ok"}
    assert r.Error == "a\uff05b" and ExtenderBindingResult(Error="100%").Error == "100\uff05"
    assert go_sprintf(readable("a % b %d")) == readable("a % b %d")


def _events(api: KubeAPI, pod: str, reason: str = "FailedScheduling") -> list[str]:
    return [e["message"] for e in api.objects("events") if e["involvedObject"]["name"] == pod and e["reason"] == reason]


def _condition(api: KubeAPI, pod: str) -> str:
    [c] = [c for c in api.get("pods", pod)["status"]["conditions"] if c["type"] == "PodScheduled"]
    return str(c["message"])


def test_a_pod_short_of_compute_reads_percent_in_its_event(kubeapi: KubeAPI) -> None:
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("busy", mem=1024, cores=80))
        assert ks.schedule_one("default", "busy").status == "Scheduled"
        kubeapi.create("pods", vgpu_pod("more", mem=1024, cores=30))
        r = ks.schedule_one("default", "more")
        assert r.status == "Unschedulable"
        note = _events(kubeapi, "more")[-1]
        assert f"{uuid('n1', 0)}: 20 percent compute free < 30 percent asked" in note
        assert "%" not in note and note == _condition(kubeapi, "more")


def test_a_percent_in_a_users_value_reads_right(kubeapi: KubeAPI) -> None:
    """An annotation the webhook would refuse (the pod came past it): the filter's reason quotes it."""
    kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        kubeapi.create("pods", vgpu_pod("odd", mem=1024, annotations={sc.NODE_POLICY_ANNOTATION: "50%"}))
        assert ks.schedule_one("default", "odd").status == "Unschedulable"
        note = _events(kubeapi, "odd")[-1]
        assert "'50\uff05': must be one of binpack, spread" in note, note
        assert "%!" not in note and note == _condition(kubeapi, "odd")


def test_without_the_fix_the_stand_in_shows_what_users_saw(kubeapi: KubeAPI) -> None:
    """An extender whose reason holds `%` (as this one's did): the event is mangled as on the real
    cluster, the condition is not."""
    import http.server
    import threading

    class Old(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(
                {"NodeNames": [], "FailedNodes": {"n1": "GPU-1: 20% compute free < 25% asked"}, "Error": ""}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        kubeapi.create("nodes", gpu_node("n1", n=1, mem_gib=16, split=4))
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(f"http://127.0.0.1:{srv.server_address[1]}")])
        kubeapi.create("pods", vgpu_pod("p", mem=1024, cores=25))
        ks.schedule_one("default", "p")
        cond = _condition(kubeapi, "p")
        assert cond.startswith("0/1 nodes are available: 1 GPU-1: 20% compute free < 25% asked."), cond
        assert _events(kubeapi, "p")[-1] == go_sprintf(cond)
        assert "GPU-1: 20%!c(MISSING)ompute free < 25%!a(MISSING)sked" in _events(kubeapi, "p")[-1]
    finally:
        srv.shutdown()
        srv.server_close()


def test_reasons_never_hold_percent_for_any_gpu_state() -> None:
    """Every reason fit_node writes, over every rule (slots, memory, compute, whole GPU, full)."""
    from vgpu_scheduler import fit, requests
    from vgpu_scheduler.config import SchedulerConfig
    from vgpu_scheduler.snapshot import GPU, NodeView

    gpu = GPU("G0", 0, "NVIDIA A100", 0, 16 * GiB, 100, 4, True)
    v = NodeView("n", (gpu,), totals=(gpu.memory, 100, 4))
    opts = requests.PodOptions(node_policy="binpack", gpu_policy="spread")
    seen: list[str] = []
    for used in (Use(0, 0, 4), Use(15 * GiB, 0, 1), Use(0, 90, 1), Use(0, 0, 1), Use(0, 100, 1)):
        for cores in (0, 30, 100):
            req = requests.ContainerRequest("main", False, 1, 4096, None, cores)
            r = fit.fit_node(v, {"G0": used}, [req], opts, SchedulerConfig())
            if isinstance(r, fit.Failure):
                assert "%" not in r.reason, r.reason
                seen.append(r.reason)
    for rule in (
        "vGPU slots used",
        "MiB free <",
        "percent compute free <",
        "whole-GPU compute asked",
        "fully allocated",
    ):
        assert any(rule in x for x in seen), (rule, seen)


# ----- replayed against a real kube-scheduler (v1.36.2; tests/data/kube-scheduler-events/README.md) -----
class _FixedExtender:
    """An extender that fails every node it is sent with the recorded reason (what the recording
    extender answered the real kube-scheduler)."""

    def __init__(self, failed: dict[str, str]) -> None:
        import http.server
        import threading

        reason = next(iter(failed.values()))

        class H(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                names = args.get("NodeNames") or []
                body = json.dumps(
                    {"NodeNames": [], "FailedNodes": dict.fromkeys(names, reason), "FailedAndUnresolvableNodes": {}}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def test_a_recorded_event_with_format_verbs_replays_exactly(kubeapi: KubeAPI) -> None:
    """The real kube-scheduler, given a reason full of `%` by an extender, wrote this event (note
    = Sprintf of the message) and this PodScheduled condition (the message as it is); the
    stand-in, given the same reason, writes both byte for byte."""
    from sim.kubeapi import node_object

    rec = json.loads((DATA / "recorder-percent-reason.json").read_text())
    [node] = rec["extender_failed_nodes"]
    ext = _FixedExtender(rec["extender_failed_nodes"])
    try:
        kubeapi.create("nodes", node_object(node))
        pod = {
            "metadata": {"name": "rec", "namespace": "default"},
            "spec": {"containers": [{"name": "main", "image": "pause", "resources": rec["pod_spec_resources"]}]},
        }
        kubeapi.create("pods", pod)
        managed = {r: True for r in rec["pod_spec_resources"]["limits"]}
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(ext.url, managed_resources=managed)], "recorder")
        assert ks.schedule_one("default", "rec").status == "Unschedulable"
    finally:
        ext.close()
    real_note = rec["event_events_k8s_io_v1"]["note"]
    assert real_note == rec["event_core_v1"]["message"]  # one Event, two views of the API
    assert "%!c(MISSING)ompute" in real_note  # what users saw
    assert _events(kubeapi, "rec")[0] == real_note
    assert _condition(kubeapi, "rec") == rec["pod_scheduled_condition"]["message"]


def test_a_recorded_event_of_this_extender_replays_exactly(kubeapi: KubeAPI) -> None:
    """The real cluster: a 20480 MiB pod (admitted by the webhook's default) on a node of two
    16 GiB GPUs. Its recorded event reads right (no verb, the condition's very text), and this
    extender behind the stand-in, given the recorded node and pod, writes the same text."""
    rec = json.loads((DATA / "vgpu-extender-oversized.json").read_text())
    note = rec["event_events_k8s_io_v1"]["note"]
    assert "%" not in note and note == rec["event_core_v1"]["message"]
    assert "never fits this node" in note and "Preemption is not helpful for scheduling" in note
    # The condition is the pod's last attempt, once the node was full: kube-scheduler's own filters
    # failed, its dry run proposed victims, the preempt verb left the node out. (Its event folded
    # into the first one's series, which keeps the first note: client-go events getKey has no note.)
    last = rec["pod_scheduled_condition"]["message"]
    assert last.endswith("preemption: no candidate node for preemption") and "%" not in last
    inv = sc.decode_inventory(rec["node_inventory_annotation"])
    inv.heartbeat = __import__("time").time()  # the recording's is hours old: fresh, as the plugin keeps it
    node = {
        "metadata": {"name": rec["node_name"]},
        "status": {
            "capacity": dict(rec["node_allocatable"]),
            "allocatable": dict(rec["node_allocatable"]),
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    node["metadata"]["annotations"] = {sc.INVENTORY_ANNOTATION: sc.encode(inv)}
    kubeapi.create("nodes", node)
    pod = {"metadata": {"name": "huge", "namespace": "default"}, "spec": dict(rec["pod"]["spec"])}
    kubeapi.create("pods", pod)
    with running_scheduler(kubeapi) as s:
        ks = KubeScheduler(kubeapi.api_client(), [ExtenderConfig(s.url)])
        assert ks.schedule_one("default", "huge").status == "Unschedulable"
    assert _events(kubeapi, "huge")[0] == note
    assert _condition(kubeapi, "huge") == note
