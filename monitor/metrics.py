"""Prometheus metrics, served by prometheus-client's HTTP server.

A custom collector turns the monitor's latest snapshot (rebuilt every second
by the main loop, replaced atomically) into metric families, so a scrape never
touches live monitor state.  Names:

per GPU (labels gpu, uuid; a MIG device is a GPU of its own here: uuid its `MIG-...` UUID,
gpu its GPU's index):
  vgpu_gpu_up, vgpu_gpu_memory_total_bytes, vgpu_gpu_memory_used_bytes,
  vgpu_gpu_utilization_percent
per MIG device (labels gpu, uuid, parent_uuid):
  vgpu_mig_device_info (1), vgpu_mig_compute_shares_enforced (0: NVML has no per-process use on MIG)
per container and GPU (labels container_id, namespace, pod, container, claim, gpu, uuid), for every
GPU the container is allocated on (used 0 while it has no process there) or has a process on:
  vgpu_container_memory_used_bytes, vgpu_container_memory_limit_bytes,
  vgpu_container_memory_device_limit_bytes, vgpu_container_memory_host_bytes,
  vgpu_container_sm_use_percent, vgpu_container_sm_share_percent,
  vgpu_container_duty_ratio
per container (labels container_id, namespace, pod, container, claim):
  vgpu_container_suspended (0/1), vgpu_container_suspended_seconds_total,
  vgpu_container_suspensions_total, vgpu_container_backstop_actions_total{action},
  vgpu_container_region_corrupt (0/1), vgpu_container_region_corruptions_total
the monitor:
  vgpu_monitor_loop_duration_seconds (histogram), vgpu_monitor_errors_total{kind} (every kind
  from start-up, at 0), vgpu_monitor_sample_holds_total, vgpu_monitor_suspended_processes,
  vgpu_monitor_guardian_armed, vgpu_monitor_gc_removed_total

A "container" is a slice: a container of the device-plugin path (claim "") or a DRA claim
(container_id `claim:<uid>`, claim = its name, pod = the pods it was reserved for, container "":
one slice shared by its containers). The claim label is empty on the device-plugin path, which in
Prometheus is the label being absent: the series of that path are the same as before it existed.

Every family name is unique, suffixes included, so the exposition is valid in the Prometheus text
format and in OpenMetrics (which Prometheus asks for first, and which forbids two families of one
name: a gauge `x` next to a counter `x` with its `x_total` sample is rejected or mistyped).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CLABELS = ["container_id", "namespace", "pod", "container", "claim"]


class SnapshotCollector:
    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        snap: dict[str, Any] = self.monitor.snapshot
        if not snap:
            return
        gl = ["gpu", "uuid"]
        up = GaugeMetricFamily("vgpu_gpu_up", "1 while NVML answers for the GPU", labels=gl)
        mt = GaugeMetricFamily("vgpu_gpu_memory_total_bytes", "GPU memory size", labels=gl)
        mu = GaugeMetricFamily("vgpu_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=gl)
        ut = GaugeMetricFamily("vgpu_gpu_utilization_percent", "GPU utilisation (NVML)", labels=gl)
        cl = [*CLABELS, "gpu", "uuid"]
        cmu = GaugeMetricFamily(
            "vgpu_container_memory_used_bytes", "GPU memory of the container's processes (NVML)", labels=cl
        )
        cml = GaugeMetricFamily(
            "vgpu_container_memory_limit_bytes", "the container's GPU memory limit (its slice)", labels=cl
        )
        cmd = GaugeMetricFamily(
            "vgpu_container_memory_device_limit_bytes",
            "the container's physical share: what may be resident on the GPU",
            labels=cl,
        )
        cmh = GaugeMetricFamily(
            "vgpu_container_memory_host_bytes",
            "oversubscribed bytes the container holds in host memory (the library's count, from the region)",
            labels=cl,
        )
        csu = GaugeMetricFamily("vgpu_container_sm_use_percent", "SM use over the window", labels=cl)
        css = GaugeMetricFamily("vgpu_container_sm_share_percent", "the container's compute share", labels=cl)
        cdr = GaugeMetricFamily("vgpu_container_duty_ratio", "fraction of each cycle the container runs", labels=cl)
        ml = ["gpu", "uuid", "parent_uuid"]
        mi = GaugeMetricFamily("vgpu_mig_device_info", "a MIG device and its GPU", labels=ml)
        me = GaugeMetricFamily(
            "vgpu_mig_compute_shares_enforced", "1 when compute shares are enforced on the MIG device", labels=ml
        )
        for g in snap["gpus"]:
            lv = [str(g["index"]), g["uuid"]]
            if g.get("parent"):
                mi.add_metric([*lv, g["parent"]], 1.0)
                me.add_metric([*lv, g["parent"]], 1.0 if g.get("compute_enforced", True) else 0.0)
            up.add_metric(lv, 1.0 if g["up"] else 0.0)
            mt.add_metric(lv, g["memory_total"])
            mu.add_metric(lv, g["memory_used"])
            ut.add_metric(lv, g["util"])
            # with processes on the GPU: measured; allocated but idle: used 0, runs the whole cycle
            idle = [{**r, "memory_used": 0, "sm_use": 0.0, "duty": 1.0} for r in g.get("allocated", ())]
            for r in [*g["containers"], *idle]:
                v = [r["container_id"], r["namespace"], r["pod"], r["container"], r.get("claim", ""), *lv]
                cmu.add_metric(v, r["memory_used"])
                if r["memory_limit"] is not None:
                    cml.add_metric(v, r["memory_limit"])
                if r.get("memory_device_limit") is not None:
                    cmd.add_metric(v, r["memory_device_limit"])
                cmh.add_metric(v, r.get("memory_host", 0))
                csu.add_metric(v, r["sm_use"])
                if r["share"] is not None:
                    css.add_metric(v, r["share"])
                cdr.add_metric(v, r["duty"])
        yield from (up, mt, mu, ut, cmu, cml, cmd, cmh, csu, css, cdr, mi, me)

        sus = GaugeMetricFamily("vgpu_container_suspended", "1 while the container is suspended", labels=CLABELS)
        sec = CounterMetricFamily(
            "vgpu_container_suspended_seconds", "time the container spent suspended", labels=CLABELS
        )
        cnt = CounterMetricFamily("vgpu_container_suspensions", "suspensions of the container", labels=CLABELS)
        bs = CounterMetricFamily(
            "vgpu_container_backstop_actions", "memory backstop actions", labels=[*CLABELS, "action"]
        )
        rc = GaugeMetricFamily("vgpu_container_region_corrupt", "1 while the region fails validation", labels=CLABELS)
        rct = CounterMetricFamily(
            "vgpu_container_region_corruptions", "times the region was found corrupt (per reason)", labels=CLABELS
        )
        for c in snap["containers"]:
            v = [c["container_id"], c["namespace"], c["pod"], c["container"], c.get("claim", "")]
            sus.add_metric(v, 1.0 if c["suspended"] else 0.0)
            sec.add_metric(v, c["suspended_seconds"])
            cnt.add_metric(v, c["suspensions"])
            for action in ("kill", "log"):
                bs.add_metric([*v, action], c["backstop_actions"].get(action, 0))
            rc.add_metric(v, 1.0 if c["region_error"] else 0.0)
            rct.add_metric(v, c["region_corrupt_total"])
        yield from (sus, sec, cnt, bs, rc, rct)

        err = CounterMetricFamily("vgpu_monitor_errors", "monitor errors by kind", labels=["kind"])
        errors = dict(snap["errors"])
        errors["nvml_call"] = snap.get("nvml_errors", 0)
        for kind, n in sorted(errors.items()):
            err.add_metric([kind], n)
        yield err
        yield CounterMetricFamily(
            "vgpu_monitor_sample_holds",
            "times the duties were held because NVML had no new samples (an idle GPU): not an error",
            value=snap.get("sample_holds", 0),
        )
        yield GaugeMetricFamily(
            "vgpu_monitor_suspended_processes", "processes suspended now", value=snap["suspended_processes"]
        )
        yield GaugeMetricFamily(
            "vgpu_monitor_guardian_armed", "1 while the guardian is armed", value=1.0 if snap["guardian_armed"] else 0.0
        )
        yield CounterMetricFamily("vgpu_monitor_gc_removed", "state directories removed", value=snap["gc_removed"])


def serve(monitor: Any, address: str, port: int) -> int:
    """Start the HTTP server on its own thread; returns the bound port."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(monitor))  # type: ignore[arg-type]
    monitor.loop_hist = Histogram(
        "vgpu_monitor_loop_duration_seconds",
        "duration of one observation loop",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
        registry=reg,
    )
    server, _thread = start_http_server(port, addr=address, registry=reg)
    return int(server.server_address[1])
