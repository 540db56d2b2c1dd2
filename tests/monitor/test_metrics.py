"""What /metrics says, scraped over HTTP from the monitor loop (scripted NVML stand-in, real
processes and guardian): every error kind from start-up, idleness is no error, an idle
container keeps its series, and the exposition is valid OpenMetrics as Prometheus asks for it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from monitor import cleanup
from tests.monitor.helpers import Procs, ScriptedSource, make_container, state
from tests.support.poll import poll

pytestmark = pytest.mark.timeout(90)
U0 = "GPU-00000000-0000-0000-0000-00000000000a"
U1 = "GPU-00000000-0000-0000-0000-00000000000b"
GIB = 1 << 30
# What Prometheus 2.42 sends (scrape/scrape.go, scrapeAcceptHeader): OpenMetrics first.
# docs/operators/metrics.md, "Error kinds"
ERROR_KINDS = ("actuate", "context_sizes", "gc", "loop", "nvml", "nvml_call", "nvml_hang", "region_write", "status")
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def samples(text: str, name: str, **labels: str) -> list[float]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append(s.value)
    return out


def one(text: str, name: str, **labels: str) -> float | None:
    got = samples(text, name, **labels)
    assert len(got) <= 1, (name, labels, got)
    return got[0] if got else None


def test_every_error_kind_exists_from_start_up(run_monitor) -> None:
    r = run_monitor(ScriptedSource({U0: {}}), metrics_port=0)
    text = r.scrape()  # the first scrape, before anything could have gone wrong
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "vgpu_monitor_errors")
    assert {s.labels["kind"]: s.value for s in fam.samples} == dict.fromkeys(ERROR_KINDS, 0.0)
    assert one(text, "vgpu_monitor_sample_holds_total") == 0


def test_a_gpu_going_idle_is_not_an_error(tmp_path: Path, procs: Procs, run_monitor) -> None:
    a = procs.spawn(["sleep", "120"])
    b = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "ctr-a", a.pid, [(U0, GIB, 10)])
    make_container(st, "ctr-b", b.pid, [(U0, GIB, 90)])
    src = ScriptedSource({U0: {a.pid: GIB, b.pid: GIB}})
    r = run_monitor(src, policy="strict", metrics_port=0)
    assert poll(lambda: state(a.pid) == "T", 10)  # throttling: duties below 1
    src.idle = {a.pid, b.pid}  # the jobs finish their work: no samples any more
    time.sleep(3.0)  # the duties were held, then released (STALE_HOLD_S = 1 s)
    assert poll(lambda: state(a.pid) != "T", 5)
    text = r.scrape()
    fam = next(f for f in text_string_to_metric_families(text) if f.name == "vgpu_monitor_errors")
    errors = {s.labels["kind"]: s.value for s in fam.samples}
    assert errors == dict.fromkeys(errors, 0.0), errors
    assert (one(text, "vgpu_monitor_sample_holds_total") or 0) >= 1  # counted where it belongs


def test_an_idle_container_keeps_its_series(tmp_path: Path, procs: Procs, run_monitor) -> None:
    busy = procs.spawn(["sleep", "120"])
    idle = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "busy", busy.pid, [(U0, 4 * GIB, 60)], pod="p-busy", namespace="ns-busy")
    # allocated on both GPUs, no GPU process yet (a notebook between runs)
    make_container(st, "idle", idle.pid, [(U0, 2 * GIB, 40), (U1, 3 * GIB, 25)], pod="p-idle", namespace="ns-idle")
    src = ScriptedSource({U0: {busy.pid: GIB}, U1: {}})
    r = run_monitor(src, policy="strict", metrics_port=0)
    assert poll(lambda: one(r.scrape(), "vgpu_container_memory_used_bytes", container_id="busy") == GIB, 10)
    text = r.scrape()
    for gpu, uuid, limit, share in (("0", U0, 2 * GIB, 40), ("1", U1, 3 * GIB, 25)):
        lab = {"container_id": "idle", "namespace": "ns-idle", "pod": "p-idle", "container": "main", "gpu": gpu}
        lab["uuid"] = uuid
        assert one(text, "vgpu_container_memory_limit_bytes", **lab) == limit
        assert one(text, "vgpu_container_memory_used_bytes", **lab) == 0
        assert one(text, "vgpu_container_sm_share_percent", **lab) == share
        assert one(text, "vgpu_container_sm_use_percent", **lab) == 0
        assert one(text, "vgpu_container_duty_ratio", **lab) == 1
    # it starts work on GPU 0, then stops: measured while it runs, back to 0 after, never gone
    src.gpus[U0] = {**src.gpus[U0], idle.pid: GIB // 2}  # replaced whole: the NVML thread reads it

    def used() -> float | None:
        return one(r.scrape(), "vgpu_container_memory_used_bytes", container_id="idle", gpu="0")

    assert poll(lambda: used() == GIB // 2, 10)
    src.gpus[U0] = {busy.pid: GIB}
    assert poll(lambda: used() == 0, 10)
    assert one(r.scrape(), "vgpu_container_memory_limit_bytes", container_id="idle", gpu="0") == 2 * GIB
    # the status file (vgpuctl status) lists it with the GPU's allocations
    import json

    status = json.loads(Path(r.mon.paths.status_path).read_text())
    assert [a["container_id"] for a in status["gpus"][1]["allocated"]] == ["idle"]


def test_exposition_is_valid_openmetrics_and_text(tmp_path: Path, procs: Procs, run_monitor) -> None:
    a = procs.spawn(["sleep", "120"])
    st = tmp_path / "state"
    make_container(st, "ctr-a", a.pid, [(U0, GIB, 50)])
    (st / "containers" / "ctr-a" / "region").write_bytes(b"\xff" * 4096)  # a corrupt region: both its series
    r = run_monitor(ScriptedSource({U0: {a.pid: GIB}}), metrics_port=0)
    assert poll(lambda: one(r.scrape(), "vgpu_container_region_corrupt", container_id="ctr-a") == 1, 10)
    om = r.scrape(PROMETHEUS_ACCEPT)
    assert om.endswith("# EOF\n")
    fams = {f.name: f for f in om_families(om)}  # strict: raises on clashing names, bad suffixes, order
    assert fams["vgpu_container_region_corrupt"].type == "gauge"
    assert fams["vgpu_container_region_corruptions"].type == "counter"
    assert fams["vgpu_monitor_errors"].type == "counter"
    assert fams["vgpu_monitor_loop_duration_seconds"].type == "histogram"
    assert [s.value for s in fams["vgpu_container_region_corruptions"].samples if s.name.endswith("_total")] == [1]
    text = r.scrape()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # the same families either way (the text format lists the histogram's _created as a gauge of its own)
    assert set(fams) == {n for n in names if not n.endswith("_created")}


def test_a_directory_gc_cannot_remove_is_counted(
    tmp_path: Path, procs: Procs, run_monitor, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = procs.spawn(["true"])
    dead.wait()
    st = tmp_path / "state"
    make_container(st, "gone", dead.pid, [(U0, GIB, 50)])

    def refuse(path: str, *a: object, **kw: object) -> None:
        raise PermissionError(13, "Permission denied", path)

    rmtree = shutil.rmtree
    monkeypatch.setattr(cleanup.shutil, "rmtree", refuse)
    r = run_monitor(ScriptedSource({U0: {}}), gc_grace_s=0.5, metrics_port=0)
    assert poll(lambda: (one(r.scrape(), "vgpu_monitor_errors_total", kind="gc") or 0) >= 1, 10)
    assert (st / "containers" / "gone").is_dir()
    monkeypatch.setattr(cleanup.shutil, "rmtree", rmtree)  # fixed: removed at the next round
    assert poll(lambda: not (st / "containers" / "gone").exists(), 10)
    assert poll(lambda: one(r.scrape(), "vgpu_monitor_gc_removed_total") == 1, 5)  # the next snapshot
