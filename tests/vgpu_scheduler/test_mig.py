"""Dynamic MIG in the scheduler: the smallest profile that holds a request (NVIDIA's H200 table),
its placement on a GPU whose memory slices the node's instances and the pods' decisions and
published slices take, the contract's version 3 inventory and the decision's `mig` field, and
the extender's filter and bind writing it."""

from __future__ import annotations

import re
import time

import msgspec
import pytest

from sim.kubeapi import KubeAPI, node_object, pod_object
from tests.support.http import post_ok
from tests.support.inventory import h200_mig, inventory, mig_inventory, uuid
from tests.vgpu_scheduler.helpers import MiB, decision_of, running_scheduler
from vgpu import scheduling as sc
from vgpu_scheduler import fit, mig, snapshot
from vgpu_scheduler.config import SchedulerConfig
from vgpu_scheduler.requests import ContainerRequest, PodOptions, RequestError, pod_options

CFG = SchedulerConfig()
GiB = 1 << 30


def node(name: str, inv: sc.NodeInventory) -> dict:
    return node_object(name, {sc.INVENTORY_ANNOTATION: sc.encode(inv)}, gpus=len(inv.gpus) * inv.split_count)


def view(inv: sc.NodeInventory, name: str = "n1") -> snapshot.NodeView:
    return snapshot.node_view(snapshot.node_info(node(name, inv)), time.time(), 120)


def req(mem: int | None = None, cores: int | None = None, name: str = "main", init: bool = False, count: int = 1):
    return ContainerRequest(name, init, count, mem, None, cores)


MIG = PodOptions("binpack", "binpack", mig=True)


def instances(p: fit.Placement | fit.Failure) -> list[tuple[str, str, int]]:
    assert isinstance(p, fit.Placement), p
    out = []
    for c in p.containers:
        for g in c.gpus:
            assert isinstance(g.mig, sc.MigAssignment)
            out.append((c.name, g.mig.profile, g.mig.start))
    return out


@pytest.mark.parametrize(
    ("mib", "cores", "profile"),
    [
        (20 * 1024, None, "1g.35gb"),  # 1g.18gb (16 GiB) is too small; 1g.35gb before 2g.35gb (fewer slices)
        (16 * 1024, None, "1g.18gb"),
        (16 * 1024 + 1, None, "1g.35gb"),
        (33280, None, "1g.35gb"),
        (40 * 1024, None, "3g.71gb"),
        (100 * 1024, None, "7g.141gb"),
        (1024, 15, "2g.35gb"),  # 1g is 14 percent of the compute, 2g 28
        (1024, 50, "4g.71gb"),  # 3g is 42 percent, 4g 57
        (1024, 100, "7g.141gb"),
    ],
)
def test_the_smallest_profile_that_holds_the_request(mib: int, cores: int | None, profile: str) -> None:
    p = fit.fit_node(view(mig_inventory("n1")), {}, [req(mib, cores)], MIG, CFG)
    [(_, got, _)] = instances(p)
    assert got == profile
    assert isinstance(p, fit.Placement)
    [g] = p.containers[0].gpus
    prof = next(x for x in h200_mig().profiles if x.name == profile)
    assert g.memory == prof.memory and g.cores == mig.cores_of(prof, h200_mig())


def test_nothing_holds_more_than_the_gpu() -> None:
    p = fit.fit_node(view(mig_inventory("n1")), {}, [req(150 * 1024)], MIG, CFG)
    assert isinstance(p, fit.Failure)
    assert f"{uuid('n1', 0)}: no MIG profile holds 153600 MiB and 14 percent compute" in p.reason


def test_placements_fill_without_overlap_and_then_the_gpu_is_full() -> None:
    """Seven 1g.18gb instances, one per container: every start 0..6 once; the eighth finds no
    placement (the H200 has seven 1g slices)."""
    reqs = [req(8 * 1024, name=f"c{i}") for i in range(7)]
    p = fit.fit_node(view(mig_inventory("n1", split=8)), {}, reqs, MIG, CFG)
    got = instances(p)
    assert {x[1] for x in got} == {"1g.18gb"} and sorted(x[2] for x in got) == list(range(7))
    p = fit.fit_node(view(mig_inventory("n1", split=8)), {}, [*reqs, req(1024, name="c7")], MIG, CFG)
    assert isinstance(p, fit.Failure)
    assert "no free placement for MIG 1g.18gb (memory slices taken: 0,1,2,3,4,5,6)" in p.reason


def test_the_first_instance_goes_where_it_harms_least() -> None:
    """The placement that leaves the most placements of all profiles: a 1g at 6 and a 2g at 4 on
    an empty GPU, as the MIG user guide's examples show the driver place them."""
    assert instances(fit.fit_node(view(mig_inventory("n1")), {}, [req(8 * 1024)], MIG, CFG))[0][1:] == ("1g.18gb", 6)
    assert instances(fit.fit_node(view(mig_inventory("n1")), {}, [req(1024, 20)], MIG, CFG))[0][1:] == ("2g.35gb", 4)
    assert instances(fit.fit_node(view(mig_inventory("n1")), {}, [req(40 * 1024)], MIG, CFG))[0][1:] == ("3g.71gb", 4)


def test_the_nodes_instances_take_their_slices() -> None:
    """Instances the node published (an administrator's, or created for a pod and not destroyed
    yet) take their memory slices: a 3g.71gb at 4 leaves 0..3 for the 20 GiB pod (at 0 or 2 the
    same is left: the lower)."""
    inv = mig_inventory("n1", instances=[("3g.71gb", 4)])
    assert instances(fit.fit_node(view(inv), {}, [req(20 * 1024)], MIG, CFG))[0][1:] == ("1g.35gb", 0)
    full = mig_inventory("n1", instances=[("3g.71gb", 0), ("3g.71gb", 4)])
    p = fit.fit_node(view(full), {}, [req(20 * 1024)], MIG, CFG)
    assert isinstance(p, fit.Failure) and "memory slices taken: 0,1,2,3,4,5,6,7" in p.reason


def _decided(uid: str, gpu: str, mib: int, profile: str, start: int, size: int) -> snapshot.PodRec:
    a = sc.MigAssignment(profile=profile, id=15, start=start, size=size)
    d = sc.Decision(
        node="n1",
        time=1.0,
        containers=[
            sc.ContainerDecision(name="main", gpus=[sc.GPUAssignment(uuid=gpu, memory=mib * MiB, cores=14, mig=a)])
        ],
    )
    return snapshot.PodRec(
        uid=uid, namespace="default", name=uid, node="n1", phase="Pending", deleting=False, decision=d
    )


def test_decided_and_published_instances_take_their_slices_until_the_pod_ends() -> None:
    """A pod's decision holds its instance's slices before the node created it (and a scheduler
    that restarts rebuilds that from the pods alone); the node's published slice holds them after;
    a Succeeded pod's decision holds nothing (its instance, until the node destroys it, is in the
    inventory)."""
    gpu = uuid("n1", 0)
    v = view(mig_inventory("n1"))
    held = [_decided(f"p{s}", gpu, 33280, "1g.35gb", s, 2) for s in (0, 2, 4)]
    usage = snapshot.usage_of(held)["n1"]
    assert sc.mig_taken(usage[gpu].mig) == 0b00111111
    assert instances(fit.fit_node(v, usage, [req(20 * 1024)], MIG, CFG))[0][1:] == ("1g.35gb", 6)
    # published: the node's slice of the same instance counts once with its pod's decision
    pub = sc.UsedSlice(
        gpu=gpu, memory=33280 * MiB, cores=14, pod="p0", container="main",
        mig=sc.MigAssignment(profile="1g.35gb", id=15, start=0, size=2),
    )  # fmt: skip
    info = snapshot.node_info(node("n1", mig_inventory("n1")))
    info = snapshot.NodeInfo(
        **{**{f: getattr(info, f) for f in info.__dataclass_fields__}, "used": sc.NodeUsage(time=1.0, slices=[pub])}
    )
    both = snapshot.usage_of(held, [info])["n1"][gpu]
    assert both.mig == usage[gpu].mig and both.slots == 3
    # the pod ended: its decision and its published slice hold nothing
    ended = [msgspec.structs.replace(held[0], phase="Succeeded"), *held[1:]]
    after = snapshot.usage_of(ended, [info])["n1"][gpu]
    assert sc.mig_taken(after.mig) == 0b00111100


def test_the_pods_own_containers_get_distinct_instances_init_included() -> None:
    """Two app containers and an init container: three instances, none overlapping; the init
    container's stays taken (it lives as long as the pod)."""
    reqs = [req(20 * 1024, name="setup", init=True), req(20 * 1024, name="a"), req(20 * 1024, name="b")]
    got = instances(fit.fit_node(view(mig_inventory("n1")), {}, reqs, MIG, CFG))
    assert [x[1] for x in got] == ["1g.35gb"] * 3 and len({x[2] for x in got}) == 3
    d = sc.Decision(
        node="n1", time=1.0, containers=fit.fit_node(view(mig_inventory("n1")), {}, reqs, MIG, CFG).containers
    )  # type: ignore[union-attr]
    use = sc.decision_usage(d)[uuid("n1", 0)]
    assert bin(sc.mig_taken(use.mig)).count("1") == 6


def test_mig_pods_only_go_where_instances_are_created_and_others_get_one_there() -> None:
    """`vgpu.k8s.io/mig: true` pods skip GPUs that do not create instances; a pod without it on
    a GPU that does (the node chose dynamic MIG) gets an instance too: CUDA cannot use a GPU in
    MIG mode whole."""
    p = fit.fit_node(view(inventory("plain", n=2)), {}, [req(20 * 1024)], MIG, CFG)
    assert isinstance(p, fit.Failure)
    assert f"{uuid('plain', 0)}: no MIG instances created here ({sc.MIG_ANNOTATION} asked)" in p.reason
    plain = PodOptions("binpack", "binpack")
    assert instances(fit.fit_node(view(mig_inventory("n1")), {}, [req(20 * 1024)], plain, CFG))[0][1] == "1g.35gb"
    # the default size on a MIG GPU: its 1/K slice (143771 MiB / 7 = 20538 MiB) -> 1g.35gb
    assert instances(fit.fit_node(view(mig_inventory("n1")), {}, [req()], plain, CFG))[0][1] == "1g.35gb"


def test_the_annotation_is_validated() -> None:
    assert pod_options({sc.MIG_ANNOTATION: "true"}, "binpack", "spread").mig
    assert not pod_options({sc.MIG_ANNOTATION: "false"}, "binpack", "spread").mig
    assert not pod_options({}, "binpack", "spread").mig
    with pytest.raises(RequestError, match=re.escape("vgpu.k8s.io/mig='maybe': must be true or false")):
        pod_options({sc.MIG_ANNOTATION: "maybe"}, "binpack", "spread")


def test_contract_versions() -> None:
    """Version 3 carries `mig`; version 2 documents are what they were (no `mig` key); a decision
    names its instance, and one without is what it was."""
    inv = mig_inventory("n1")
    again = sc.decode_inventory(sc.encode(inv))
    assert again.version == 3 and again.gpus[0].mig == inv.gpus[0].mig
    assert '"mig"' not in sc.encode(inventory("n1"))
    with pytest.raises(sc.ContractError, match="version 4, expected 2 or 3"):
        sc.decode_inventory(sc.encode(msgspec.structs.replace(inv, version=4)))
    plain = sc.GPUAssignment(uuid="GPU-1", memory=1, cores=2)
    assert sc.encode(plain) == '{"uuid":"GPU-1","memory":1,"cores":2}'


def test_extender_filter_and_bind_write_the_instance(kubeapi: KubeAPI) -> None:
    """Through the extender: the MIG pod goes to the H200 node, not the plain one, and the
    Binding's decision names the 1g.35gb instance and its placement; the next pod's filter
    counts it (the decision holds its slices before the node created it)."""
    kubeapi.create("nodes", node("plain", inventory("plain", n=1, mem_gib=80)))
    kubeapi.create("nodes", node("h200", mig_inventory("h200")))
    lim = {sc.RESOURCE_GPU: "1", sc.RESOURCE_MEM: str(20 * 1024)}
    ann = {sc.MIG_ANNOTATION: "true"}
    pods = [
        kubeapi.create("pods", pod_object(n, [("main", lim)], annotations=ann, scheduler="vgpu-scheduler"))
        for n in ("a", "b")
    ]
    with running_scheduler(kubeapi) as s:
        starts = []
        for pod in pods:
            out = post_ok(s.url + "/filter", {"Pod": pod, "Nodes": None, "NodeNames": ["plain", "h200"]})
            assert out["NodeNames"] == ["h200"], out
            meta = pod["metadata"]
            bind = {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"], "Node": "h200"}
            assert post_ok(s.url + "/bind", bind) == {"Error": ""}
            d = decision_of(kubeapi, meta["name"])
            assert d is not None
            [g] = d.containers[0].gpus
            assert isinstance(g.mig, sc.MigAssignment)
            assert (g.uuid, g.mig.profile, g.mig.id, g.mig.size, g.memory) == (
                uuid("h200", 0),
                "1g.35gb",
                15,
                2,
                33280 * MiB,
            )
            starts.append(g.mig.start)
        assert starts == [6, 4]
