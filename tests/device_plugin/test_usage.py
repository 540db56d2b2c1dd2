"""What the node handed out (`vgpu.k8s.io/node-usage`) and its node-level totals in the Node's
status: from the plugin's allocation records, through the kubelet stand-in (real gRPC) and the
Kubernetes API stand-in (real HTTP, the kubernetes client unmodified)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from device_plugin import usage
from device_plugin.allocator import slice_for
from device_plugin.api import deviceplugin_pb2 as pb
from nodecore import records
from nodecore.devices import DeviceTable, Slicing
from sim import kubelet_checkpoint as kc
from sim.kubeapi import KubeAPI, pod_object
from sim.kubelet import ContainerSpec, FakeKubelet
from tests.device_plugin.conftest import GPUS, NODE, U0, U1, GiB, InProc, add_pod
from tests.support.poll import wait_for
from vgpu import scheduling
from vgpu.paths import Paths
from vgpu.schemas import TOKEN_ENV, AllocatedGPU, AllocationRecord
from vgpuctl import cluster

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def rec(token: str, created: float, *gpus: tuple[str, int, int, list[str]]) -> AllocationRecord:
    return AllocationRecord(
        token=token * 32,
        created=created,
        gpus=[AllocatedGPU(uuid=u, memory_limit=m, core_percent=c, vgpu_ids=ids) for u, m, c, ids in gpus],
    )


def test_one_slice_per_slot_and_record_the_newest_pod_owns_a_slot() -> None:
    recs = [
        rec("e", 0, (U1, 2 * GiB, 20, [f"{U1}::1"])),  # an ended pod's record (still kept) ...
        rec("g", 0.5, (U1, 1 * GiB, 5, [f"{U1}::2"])),  # an unnamed older record ...
        rec("a", 1, (U0, 12 * GiB, 75, [f"{U0}::0", f"{U0}::1", f"{U0}::2"])),  # n x 1/K: 3 slots
        rec("b", 2, (U1, 3 * GiB, 30, [f"{U1}::0"])),  # an init container's record ...
        rec("c", 3, (U1, 5 * GiB, 40, [f"{U1}::0"])),  # ... whose slot the app container reuses
        rec("d", 4, (U1, 1 * GiB, 10, [])),  # no IDs (an older record form): counts once
        rec("f", 5, (U1, 6 * GiB, 25, [f"{U1}::1"])),  # ... whose slot the kubelet gave a new pod
        rec("h", 6, (U1, 2 * GiB, 5, [f"{U1}::2"])),  # ... and a newer unnamed one on its slot
    ]
    tags = {
        "a" * 32: ("other", "main"),
        "b" * 32: ("pod-uid", "init"),
        "c" * 32: ("pod-uid", "app"),
        "e" * 32: ("ended", "main"),
        "f" * 32: ("new", "main"),
    }
    got = [(s.gpu, s.memory, s.cores, s.pod, s.container) for s in usage.slices(recs, tags)]
    assert got == [
        (U0, 4 * GiB, 25, "other", "main"),
        (U0, 4 * GiB, 25, "other", "main"),
        (U0, 4 * GiB, 25, "other", "main"),
        (U1, 3 * GiB, 30, "pod-uid", "init"),  # one pod's records of a slot: all listed
        (U1, 5 * GiB, 40, "pod-uid", "app"),
        (U1, 1 * GiB, 10, "", ""),
        (U1, 6 * GiB, 25, "new", "main"),
        (U1, 2 * GiB, 5, "", ""),
    ]
    # The scheduler's arithmetic over it: the decided pod's init and app slices on one vGPU count
    # once, max(init, sum(app)), plus its decided container not published yet.
    d = scheduling.Decision(
        node=NODE,
        time=0,
        containers=[
            scheduling.ContainerDecision(
                name="init", init=True, gpus=[scheduling.GPUAssignment(uuid=U1, memory=3 * GiB, cores=30)]
            ),
            scheduling.ContainerDecision(
                name="app", gpus=[scheduling.GPUAssignment(uuid=U1, memory=5 * GiB, cores=40)]
            ),
            scheduling.ContainerDecision(
                name="side", gpus=[scheduling.GPUAssignment(uuid=U1, memory=2 * GiB, cores=5)]
            ),
        ],
    )
    live = {"other", "pod-uid", "new"}
    per = scheduling.node_usage(usage.slices(recs, tags), {"pod-uid": d}, live.__contains__)
    assert (per[U0].memory, per[U0].cores, per[U0].slots) == (12 * GiB, 75, 3)
    # max(3, 5 + 2) + 1 (unnamed) + 6 (new) + 2 (unnamed) GiB
    assert (per[U1].memory, per[U1].cores, per[U1].slots) == (16 * GiB, 85, 5)
    # ended pods' slices no longer hold; unnamed ones do as long as they are published
    per = scheduling.node_usage(usage.slices(recs, tags), {}, lambda uid: False)
    assert (per[U1].memory, per[U1].slots) == (3 * GiB, 2) and U0 not in per


def test_names_follow_the_kubelets_checkpoint(tmp_path: Path) -> None:
    """The tracker reads the checkpoint again when it changed; a file that cannot be read keeps the
    names read before; the checkpoint's name wins over Allocate's."""
    state = Paths(str(tmp_path / "state"))
    records.ensure_dir(state)
    table = DeviceTable(GPUS, Slicing(4, 1.0, 1.0))
    r1 = records.RecordStore(state, "nvidia.com/gpu").write(slice_for(table, [f"{U0}::0"]).gpus, False)
    r2 = records.RecordStore(state, "nvidia.com/gpu").write(slice_for(table, [f"{U1}::0"]).gpus, False)
    ck = tmp_path / "ck"
    t = usage.Tracker(state, "nvidia.com/gpu", str(ck))
    t.note(r2.token, "decided-uid", "main")
    assert not t.refresh()  # no file yet
    assert sorted((s.pod, s.container) for s in t.doc().slices) == [("", ""), ("decided-uid", "main")]

    def answer(token: str) -> bytes:
        r = pb.ContainerAllocateResponse()
        r.envs[TOKEN_ENV] = token
        return r.SerializeToString()

    def write(entries: list[kc.Entry]) -> None:
        tmp = tmp_path / "ck.tmp"
        tmp.write_bytes(kc.marshal(entries, {"nvidia.com/gpu": ["x"]}))
        os.replace(tmp, ck)  # as the kubelet writes it

    write([kc.Entry("uid-1", "main", "nvidia.com/gpu", {-1: [f"{U0}::0"]}, answer(r1.token))])
    assert t.refresh() and not t.refresh()
    assert sorted((s.pod, s.container) for s in t.doc().slices) == [("decided-uid", "main"), ("uid-1", "main")]
    write(
        [
            kc.Entry("uid-1", "main", "nvidia.com/gpu", {-1: [f"{U0}::0"]}, answer(r1.token)),
            kc.Entry("uid-2", "main", "nvidia.com/gpu", {-1: [f"{U1}::0"]}, answer(r2.token)),
        ]
    )
    assert t.refresh()
    assert sorted((s.pod, s.container) for s in t.doc().slices) == [("uid-1", "main"), ("uid-2", "main")]
    ck.write_bytes(b"{garbage")
    assert not t.refresh()
    assert sorted(s.pod for s in t.doc().slices) == ["uid-1", "uid-2"]


def test_records_the_kubelet_no_longer_holds_are_not_published(tmp_path: Path) -> None:
    """After a restart (Allocate's names lost) a record that the kubelet's checkpoint, written
    later, does not hold belongs to a pod that is gone: it is not published, although it stays on
    disk for the collector's grace; one newer than the checkpoint (the moment between an answer and
    the kubelet's write) and every record while no checkpoint could be read still are."""
    state = Paths(str(tmp_path / "state"))
    records.ensure_dir(state)
    table = DeviceTable(GPUS, Slicing(4, 1.0, 1.0))
    store = records.RecordStore(state, "nvidia.com/gpu")
    held = store.write(slice_for(table, [f"{U0}::0"]).gpus, False)
    gone = store.write(slice_for(table, [f"{U1}::0"]).gpus, False)
    ck = tmp_path / "ck"
    t = usage.Tracker(state, "nvidia.com/gpu", str(ck))
    assert len(t.doc().slices) == 2  # no checkpoint: both counted, unnamed
    answer = pb.ContainerAllocateResponse()
    answer.envs[TOKEN_ENV] = held.token
    entry = kc.Entry("uid-1", "main", "nvidia.com/gpu", {-1: [f"{U0}::0"]}, answer.SerializeToString())
    ck.write_bytes(kc.marshal([entry], {"nvidia.com/gpu": ["x"]}))
    written = gone.created + 1  # too soon after the record to say the kubelet dropped it
    os.utime(ck, (written, written))
    assert sorted((s.gpu, s.pod) for s in t.doc().slices) == [(U0, "uid-1"), (U1, "")]
    written = gone.created + usage.UNHELD_AFTER_S + 1
    os.utime(ck, (written, written))
    assert [(s.gpu, s.pod) for s in t.doc().slices] == [(U0, "uid-1")]
    assert len(records.list_records(state)) == 2  # the record itself stays for the collector
    # an answer given just before the kubelet's write, not in it yet: still counted
    newer = AllocationRecord(
        token=records.new_token(),
        created=written - 1,
        resource_name="nvidia.com/gpu",
        gpus=slice_for(table, [f"{U0}::1"]).gpus,
    )
    store.restore(newer)
    assert sorted((s.gpu, s.pod) for s in t.doc().slices) == [(U0, ""), (U0, "uid-1")]


def node_usage_of(kube: KubeAPI) -> scheduling.NodeUsage | None:
    text = kube.get("nodes", NODE)["metadata"].get("annotations", {}).get(scheduling.USAGE_ANNOTATION)
    return scheduling.decode_usage(text) if text else None


def test_published_on_allocate_named_by_the_kubelet_ended_pods_stop_counting_records_stay(
    api: KubeAPI,
    kubelet: FakeKubelet,
    inproc: Callable[..., InProc],
) -> None:
    """Every published slice names its pod (decided or not, init container or app), also after a
    restart; when pods end their records stay until the kubelet rewrites its checkpoint (it may
    replay them), their slices stay published and named, and the arithmetic over the API's pods
    stops counting them at once; the kubelet's next checkpoint write collects them."""

    def start() -> InProc:
        # grace 1 s: longer than the moment between an answer and the kubelet's checkpoint write
        p = inproc(gpus=GPUS, device_split_count=4, node_name=NODE, record_gc_grace_s=1.0, record_gc_interval_s=0.2)
        kubelet.wait_endpoint()
        return p

    p = start()
    # node-level totals in the Node's status, for kube-scheduler's own fit
    want = {scheduling.RESOURCE_NODE_MEM: "32768", scheduling.RESOURCE_NODE_CORES: "200"}

    def status_ok() -> bool:
        st = api.get("nodes", NODE)["status"]
        return all(st["capacity"].get(k) == v and st["allocatable"].get(k) == v for k, v in want.items())

    wait_for(status_ok, 20, "the node-level totals in the Node's status")
    assert api.get("nodes", NODE)["status"]["allocatable"]["nvidia.com/gpu"] == "8"  # the kubelet's own kept
    # a decided pod, a pod without a decision (another scheduler's), one with an init container
    add_pod(api, "decided", [("main", False, [(U1, 3000 * MiB, 30)])])
    api.create("pods", pod_object("other", [("main", {"nvidia.com/gpu": "1"})]))
    api.create("pods", pod_object("job", [("app", {"nvidia.com/gpu": "1"})], init=[("prep", {"nvidia.com/gpu": "1"})]))
    uid = {n: api.get("pods", n)["metadata"]["uid"] for n in ("decided", "other", "job")}
    for n in ("other", "job"):
        api.bind(n, "default", NODE)
    kubelet.admit("default", "decided", "main", uid=uid["decided"])
    kubelet.admit("default", "other", "main", uid=uid["other"])
    kubelet.admit_pod("default", "job", [ContainerSpec("app", 1)], [ContainerSpec("prep", 1)], uid=uid["job"])

    def named(n: int) -> Callable[[], scheduling.NodeUsage | None]:
        def f() -> scheduling.NodeUsage | None:
            u = node_usage_of(api)
            return u if u is not None and len(u.slices) == n and all(s.pod for s in u.slices) else None

        return f

    u = wait_for(named(4), 20, "every slice published with its pod")
    got = sorted((s.pod, s.container, s.gpu, s.memory, s.cores) for s in u.slices)
    assert len({g for pod, _, g, _, _ in got if pod == uid["job"]}) == 1
    assert [x for x in got if x[0] == uid["decided"]] == [(uid["decided"], "main", U1, 3000 * MiB, 30)]
    assert [x[:2] for x in got if x[0] == uid["other"]] == [(uid["other"], "main")]
    # the init container's slot was given to the app container: both listed, counted once
    assert sorted(x[1] for x in got if x[0] == uid["job"]) == ["app", "prep"]

    v = cluster.view(api.objects("nodes"), api.objects("pods"), time.time())
    assert sum(g.slots_allocated for g in v.nodes[0].gpus) == 3  # 4 slices, 3 vGPUs
    # a burst of Allocates is a bounded number of writes (USAGE_INTERVAL_S), not one per container
    usage_patches = [r for r in api.requests if r[0] == "PATCH" and r[1] == f"/api/v1/nodes/{NODE}"]
    assert len(usage_patches) <= 6
    # restart: the names come back from the kubelet's checkpoint
    p.stop()
    api.patch("nodes", NODE, {"metadata": {"annotations": {scheduling.USAGE_ANNOTATION: None}}})
    p = start()
    u = wait_for(named(4), 20, "republished after the restart")
    assert sorted((s.pod, s.container, s.gpu) for s in u.slices) == sorted(x[:3] for x in got)
    # other and job end: the kubelet drops them but writes its checkpoint only at its next
    # allocation, so their records stay (a replay could still ask for them) and stay published
    kubelet.release("default", "other")
    kubelet.release("default", "job")
    api.delete("pods", "other")
    api.patch("pods", "job", {"status": {"phase": "Succeeded"}})
    time.sleep(2.0)  # collector passes past the grace (record_gc_interval_s 0.2, grace 1 s)
    assert len(os.listdir(p.state.allocations_dir)) == 4
    u = node_usage_of(api)
    assert u is not None and len(u.slices) == 4
    # ... and the arithmetic over the API's objects (the scheduler's and vgpuctl's) no longer
    # counts them: only the decided pod's 3000 MiB holds
    v = cluster.view(api.objects("nodes"), api.objects("pods"), time.time())
    held = {g.uuid: (g.memory_allocated, g.slots_allocated) for g in v.nodes[0].gpus}
    assert held == {U0: (0, 0), U1: (3000 * MiB, 1)}
    # the kubelet's next allocation rewrites its checkpoint: the ended pods' records go
    api.create("pods", pod_object("next", [("main", {"nvidia.com/gpu": "1"})]))
    kubelet.admit("default", "next", "main", uid=api.get("pods", "next")["metadata"]["uid"])
    wait_for(named(2), 20, "the ended pods' records collected")
    assert len(os.listdir(p.state.allocations_dir)) == 2
    p.stop()
