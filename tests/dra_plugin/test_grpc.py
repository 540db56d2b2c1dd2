"""The DRA plugin as the kubelet sees it: registration and NodePrepareResources /
NodeUnprepareResources over gRPC on unix sockets (the kubelet stand-in sim/drakubelet.py
with a client generated from the same .proto files), claims read from the API server stand-in
over HTTP by the kubernetes client."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_plugin import cdi
from dra_plugin import checkpoint as ckpt
from dra_plugin.config import Settings
from runtime_hook import prestart as hook_prestart
from sim import kubeapi
from sim.drakubelet import Claim, DRAKubelet, KubeletError, cdi_devices
from tests.dra_plugin.conftest import GIB, NODE, gpus
from tests.dra_plugin.support import Claims, Plugin, start_plugin
from vgpu import limits as vlimits
from vgpu import region as vregion
from vgpu.paths import Paths
from vgpu.schemas import AllocationRecord, read_record

pytestmark = pytest.mark.timeout(120)
DRIVER = "gpu.vgpu.k8s.io"
GPUS = gpus(2)


@pytest.fixture
def kubelet(cfg: Settings) -> Iterator[DRAKubelet]:
    with DRAKubelet(cfg.kubelet_dir) as k:
        yield k


@pytest.fixture
def plugin(cfg: Settings, kube: kubeapi.KubeAPI, kubelet: DRAKubelet) -> Iterator[Plugin]:
    p = start_plugin(cfg, GPUS, kube)
    kubelet.wait_registered(DRIVER)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def claims(kube: kubeapi.KubeAPI, cfg: Settings) -> Claims:
    return Claims(kube, cfg, GPUS)


def records(cfg: Settings) -> list[AllocationRecord]:
    d = Path(cfg.state_dir) / "allocations"
    return [read_record(str(p)) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def claim_dirs(cfg: Settings) -> list[str]:
    return sorted(p.name for p in Path(cfg.claims_dir).iterdir() if p.is_dir())


def test_registration(cfg: Settings, plugin: Plugin, kubelet: DRAKubelet) -> None:
    r = kubelet.wait_registered(DRIVER)
    assert r.socket == os.path.join(cfg.kubelet_dir, "plugins_registry", f"{DRIVER}-reg.sock")
    assert r.endpoint == os.path.join(cfg.kubelet_dir, "plugins", DRIVER, "dra.sock")
    assert r.versions == ["v1.DRAPlugin"] and r.service == "v1.DRAPlugin"
    # The kubelet's health stream, opened right after registration, is served (test_health.py).
    assert r.health == "OK"
    assert plugin.server.registration.registered.wait(5)
    assert plugin.server.registration.last_status is not None
    assert plugin.server.registration.last_status.plugin_registered


def test_prepare_6gi_30pct(cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims) -> None:
    c = claims.make({"gpu": {"memory": "6Gi", "cores": "30"}})
    result = claims.get(c)["status"]["allocation"]["devices"]["results"][0]
    [dev] = kubelet.prepare(DRIVER, [c])[c.uid]
    assert dev.request_names == ["gpu"] and dev.pool == NODE and dev.device == result["device"] == "gpu-0"
    assert dev.share_id == result["shareID"]
    assert dev.cdi_device_ids == [f"nvidia.com/gpu={GPUS[0].uuid}", f"vgpu.k8s.io/claim={c.uid}"]
    assert cdi_devices([dev], "gpu") == dev.cdi_device_ids
    # The allocation record: the device plugin's schema, readable by the hook's own reader.
    [rec] = records(cfg)
    assert rec.resource_name == DRIVER
    [g] = rec.gpus
    assert (g.uuid, g.memory_limit, g.core_percent) == (GPUS[0].uuid, 6 * GIB, 30)
    hook_view = hook_prestart.load_record(Paths(cfg.state_dir), rec.token)  # what the OCI hook reads
    assert [(x.uuid, x.memory_limit, x.core_percent) for x in hook_view.gpus] == [(g.uuid, 6 * GIB, 30)]
    # The claim's files: limits and region as the hook makes them; preload with our library.
    d = Path(cfg.claims_dir) / c.uid
    assert vlimits.parse((d / "limits").read_text()) == [
        vlimits.DeviceLimit(uuid=g.uuid, memory_limit=6 * GIB, core_percent=30, oversubscribe=False)
    ]
    reg = vregion.read_region(str(d / "region"))
    assert [(x.uuid, x.memory_limit) for x in reg.devices] == [(g.uuid, 6 * GIB)]
    assert (Path(cfg.claims_dir) / "ld.so.preload").read_text() == "/run/vgpu/libvgpu.so\n"  # one for all
    assert oct((d / "region").stat().st_mode & 0o777) == "0o666"
    meta = json.loads((d / "claim.json").read_text())
    assert meta["token"] == rec.token and meta["reserved_for"][0]["name"] == "pod-a"
    # The CDI spec: one device named by the claim, mounting exactly those files.
    spec = json.loads((Path(cfg.cdi_dir) / f"vgpu.k8s.io-claim_{c.uid}.json").read_text())
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "vgpu.k8s.io/claim"
    [sdev] = spec["devices"]
    assert sdev["name"] == c.uid
    mounts = {m["containerPath"]: (m["hostPath"], m["options"]) for m in sdev["containerEdits"]["mounts"]}
    assert mounts == {
        "/run/vgpu/libvgpu.so": (cfg.library_path, ["ro", "nosuid", "nodev", "bind"]),
        "/run/vgpu/limits": (str(d / "limits"), ["ro", "nosuid", "nodev", "bind"]),
        "/run/vgpu/region": (str(d / "region"), ["rw", "nosuid", "nodev", "bind"]),
        "/etc/ld.so.preload": (str(Path(cfg.claims_dir) / "ld.so.preload"), ["ro", "nosuid", "nodev", "bind"]),
    }
    assert not any("VGPU_ALLOCATION_TOKEN" in e for e in sdev["containerEdits"]["env"])
    cp = ckpt.load(cfg.checkpoint_path, DRIVER, NODE)
    assert list(cp.claims) == [c.uid] and cp.claims[c.uid].token == rec.token


def test_spec_carries_the_measured_context_size(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    """The monitor's measured context size of the claim's GPU goes into the claim's CDI spec as
    VGPU_CONTEXT_RESERVE; none before anything is measured on that GPU."""
    from vgpu import contextsizes

    def env(uid: str) -> list[str]:
        spec = json.loads((Path(cfg.cdi_dir) / f"vgpu.k8s.io-claim_{uid}.json").read_text())
        return spec["devices"][0]["containerEdits"]["env"]

    a = claims.make({"gpu": {"memory": "4Gi"}})
    kubelet.prepare(DRIVER, [a])
    assert env(a.uid) == [f"VGPU_CLAIM_UID={a.uid}"]  # nothing measured yet
    contextsizes.write(cfg.paths.context_sizes_path, {GPUS[0].uuid: 300 << 20, GPUS[1].uuid: 500 << 20})
    b = claims.make({"gpu": {"memory": "4Gi"}}, pods=("pod-b",))
    kubelet.prepare(DRIVER, [b])
    token = json.loads((Path(cfg.claims_dir) / b.uid / "claim.json").read_text())["token"]
    [rec] = [r for r in records(cfg) if r.token == token]
    want = {GPUS[0].uuid: 300 << 20, GPUS[1].uuid: 500 << 20}[rec.gpus[0].uuid]
    assert env(b.uid) == [f"VGPU_CLAIM_UID={b.uid}", f"VGPU_CONTEXT_RESERVE={want}"]


def test_default_share_without_capacity_request(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    c = claims.make({"gpu": {}})
    kubelet.prepare(DRIVER, [c])
    [rec] = records(cfg)
    assert (rec.gpus[0].memory_limit, rec.gpus[0].core_percent) == (8 * GIB, 50)  # 1/K, K = 2


def test_prepare_is_idempotent(cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims) -> None:
    c = claims.make({"gpu": {"memory": "4Gi"}})
    first = kubelet.prepare(DRIVER, [c])
    region = Path(cfg.claims_dir) / c.uid / "region"
    ino = region.stat().st_ino
    answers: list[object] = []

    def again() -> None:
        answers.append(kubelet.prepare(DRIVER, [c]))

    threads = [threading.Thread(target=again) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [first] * 4
    assert len(records(cfg)) == 1 and region.stat().st_ino == ino  # the region is never rewritten


def test_concurrent_first_prepares_make_one_slice(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    c = claims.make({"gpu": {"memory": "4Gi"}})
    answers: list[object] = []
    threads = [threading.Thread(target=lambda: answers.append(kubelet.prepare(DRIVER, [c]))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 6 and all(a == answers[0] for a in answers)
    assert len(records(cfg)) == 1


def test_unprepare_removes_everything(cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims) -> None:
    keep, gone = claims.make({"gpu": {"memory": "2Gi"}}), claims.make({"gpu": {"memory": "2Gi"}})
    kubelet.prepare(DRIVER, [keep, gone])
    assert len(records(cfg)) == 2
    kubelet.unprepare(DRIVER, [gone])
    assert [r.gpus[0].vgpu_ids[0].split(":dra:")[1].split(":")[0] for r in records(cfg)] == [keep.uid]
    assert not (Path(cfg.claims_dir) / gone.uid).exists()
    assert sorted(os.listdir(cfg.cdi_dir)) == [cdi.spec_file_name(keep.uid)]
    assert list(ckpt.load(cfg.checkpoint_path, DRIVER, NODE).claims) == [keep.uid]
    kubelet.unprepare(DRIVER, [gone])  # already unprepared: fine
    never = Claim("default", "never", "12345678-1234-4234-8234-123456789012")
    kubelet.unprepare(DRIVER, [never])


def test_bad_claims_fail_alone(cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims) -> None:
    good = claims.make({"gpu": {"memory": "2Gi", "cores": "1"}})

    def variant(name: str, edit: object) -> Claim:
        obj = claims.get(claims.make({"gpu": {"memory": "1Gi", "cores": "1"}}, name=f"tmpl-{name}"))
        obj["metadata"] = {"name": name, "namespace": "default"}
        edit(obj["status"]["allocation"]["devices"]["results"][0])  # type: ignore[operator]
        return claims.store(obj)

    foreign = variant("foreign", lambda r: r.update(driver="gpu.nvidia.com"))
    other_pool = variant("other-pool", lambda r: r.update(pool="node-2"))
    unknown_dev = variant("unknown-device", lambda r: r.update(device="gpu-9"))
    admin = variant("admin", lambda r: r.update(adminAccess=True))
    bad_qty = variant("bad-quantity", lambda r: r["consumedCapacity"].update(memory="lots"))
    too_big = variant("too-big", lambda r: r["consumedCapacity"].update(memory="17Gi"))
    bad_share = variant("bad-share", lambda r: r.update(shareID="../../etc"))
    unallocated = claims.store(
        {"metadata": {"name": "unallocated", "namespace": "default"}, "spec": {"devices": {"requests": []}}}
    )
    missing = Claim("default", "missing", "6f1f5c1e-0000-4000-8000-000000000000")
    replaced = Claim(good.namespace, good.name, "0a0a0a0a-0000-4000-8000-000000000000")
    bad_uid = Claim("default", "x", "../../../../etc/passwd")
    asked = [good, foreign, other_pool, unknown_dev, admin, bad_qty, too_big, bad_share, unallocated, missing, replaced]
    resp = kubelet.prepare_raw(DRIVER, [*asked, bad_uid])
    assert set(resp.claims) == {c.uid for c in [*asked, bad_uid]}
    assert not resp.claims[good.uid].error and len(resp.claims[good.uid].devices) == 1
    expect = {
        foreign.uid: "has no device of driver gpu.vgpu.k8s.io",
        other_pool.uid: "not this node's pool",
        unknown_dev.uid: "unknown device 'gpu-9'",
        admin.uid: "admin access",
        bad_qty.uid: "consumedCapacity memory",
        too_big.uid: "is outside 0..",
        bad_share.uid: "invalid shareID",
        unallocated.uid: "is not allocated",
        missing.uid: "default/missing not found",
        replaced.uid: "got replaced",
        bad_uid.uid: "invalid ResourceClaim UID",
    }
    for uid, text in expect.items():
        assert text in resp.claims[uid].error, (uid, resp.claims[uid].error)
        assert not resp.claims[uid].devices
    # Nothing of the failed claims is left behind; the good one is prepared.
    assert len(records(cfg)) == 1 and claim_dirs(cfg) == [good.uid]
    assert os.listdir(cfg.cdi_dir) == [cdi.spec_file_name(good.uid)]
    # The kubelet fails the pod on the first claim in error, as manager.go does.
    with pytest.raises(KubeletError, match="NodePrepareResources failed for ResourceClaim"):
        kubelet.prepare(DRIVER, [good, foreign])


def test_one_claim_two_gpus_and_a_subrequest(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    claims.make({"filler": {"memory": "12Gi"}})  # gpu-0 is mostly taken
    c = claims.make({"a": {"memory": "2Gi", "cores": "10"}, "b/large": {"memory": "10Gi", "cores": "60"}})
    devs = kubelet.prepare(DRIVER, [c])[c.uid]
    assert [(d.device, d.request_names) for d in devs] == [("gpu-0", ["a"]), ("gpu-1", ["b"])]
    assert cdi_devices(devs, "a") == [f"nvidia.com/gpu={GPUS[0].uuid}", f"vgpu.k8s.io/claim={c.uid}"]
    [rec] = [r for r in records(cfg) if any(c.uid in v for g in r.gpus for v in g.vgpu_ids)]
    assert [(g.uuid, g.memory_limit, g.core_percent) for g in rec.gpus] == [
        (GPUS[0].uuid, 2 * GIB, 10),
        (GPUS[1].uuid, 10 * GIB, 60),
    ]


def test_two_shares_of_one_gpu_in_one_claim_add_up(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    c = claims.make({"a": {"memory": "3Gi", "cores": "20"}, "b": {"memory": "1Gi", "cores": "5"}})
    devs = kubelet.prepare(DRIVER, [c])[c.uid]
    assert [d.device for d in devs] == ["gpu-0", "gpu-0"] and devs[0].share_id != devs[1].share_id
    [rec] = records(cfg)
    [g] = rec.gpus
    assert (g.memory_limit, g.core_percent, len(g.vgpu_ids)) == (4 * GIB, 25, 2)


def test_restart_answers_from_the_checkpoint_and_rebuilds_files(
    cfg: Settings, kube: kubeapi.KubeAPI, kubelet: DRAKubelet, claims: Claims
) -> None:
    p = start_plugin(cfg, GPUS, kube)
    kubelet.wait_registered(DRIVER)
    c = claims.make({"gpu": {"memory": "6Gi"}})
    first = kubelet.prepare(DRIVER, [c])
    p.stop()
    # The claim leaves the API server and the tmpfs of CDI specs is emptied (a reboot); the
    # kubelet, whose own checkpoint lists the claim, does not prepare it again.
    kube.delete("resourceclaims", c.name, c.namespace)
    for f in os.listdir(cfg.cdi_dir):
        os.unlink(os.path.join(cfg.cdi_dir, f))
    (Path(cfg.claims_dir) / c.uid / "limits").unlink()
    p = start_plugin(cfg, GPUS, kube)
    try:
        kubelet.wait_registered(DRIVER, count=2)
        assert os.listdir(cfg.cdi_dir) == [cdi.spec_file_name(c.uid)]  # rebuilt at start-up
        assert (Path(cfg.claims_dir) / c.uid / "limits").is_file()
        assert kubelet.prepare(DRIVER, [c]) == first  # from the checkpoint: no API read
        kubelet.unprepare(DRIVER, [c])
        assert records(cfg) == [] and claim_dirs(cfg) == []
    finally:
        p.stop()


def test_start_up_removes_leftovers_and_refuses_a_bad_checkpoint(
    cfg: Settings, kube: kubeapi.KubeAPI, claims: Claims, tmp_path: Path
) -> None:
    p = start_plugin(cfg, GPUS, None)
    p.stop()
    # Leftovers of a crash between the first write and the checkpoint: a record, a claim
    # directory and a spec of ours; a spec of another instance (other state dir) stays.
    uid = "11111111-2222-4333-8444-555555555555"
    rec = p.driver.records.write([], False)
    (Path(cfg.claims_dir) / uid).mkdir()
    (Path(cfg.claims_dir) / uid / "region").write_bytes(b"x")
    from dra_plugin.cdi import ClaimFiles, SpecDir

    specs = SpecDir(cfg.cdi_dir)
    specs.write(uid, ClaimFiles("/lib", f"{cfg.claims_dir}/{uid}/limits", f"{cfg.claims_dir}/{uid}/region", "/p"))
    other = "99999999-2222-4333-8444-555555555555"
    specs.write(other, ClaimFiles("/lib", "/elsewhere/limits", "/elsewhere/region", "/elsewhere/p"))
    p = start_plugin(cfg, GPUS, None)
    p.stop()
    assert records(cfg) == [] and not p.driver.records.has(rec.token)
    assert claim_dirs(cfg) == []
    assert os.listdir(cfg.cdi_dir) == [cdi.spec_file_name(other)]
    Path(cfg.checkpoint_path).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.checkpoint_path).write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="malformed DRA checkpoint"):
        start_plugin(cfg, GPUS, None)


def test_no_api_server_is_an_error_per_claim(
    cfg: Settings, kube: kubeapi.KubeAPI, kubelet: DRAKubelet, claims: Claims
) -> None:
    p = start_plugin(cfg, GPUS, kube)
    try:
        kubelet.wait_registered(DRIVER)
        c = claims.make({"gpu": {"memory": "1Gi"}})
        kube.fail_next("GET", r"/resourceclaims/", 503)
        resp = kubelet.prepare_raw(DRIVER, [c])
        assert "cannot be read (503" in resp.claims[c.uid].error
        assert kubelet.prepare(DRIVER, [c])[c.uid]  # the kubelet's retry succeeds
    finally:
        p.stop()


def test_missing_library_fails_the_claim_clearly(
    cfg: Settings, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    os.unlink(cfg.library_path)
    c = claims.make({"gpu": {"memory": "1Gi"}})
    resp = kubelet.prepare_raw(DRIVER, [c])
    assert f"vGPU library {cfg.library_path}: No such file or directory" in resp.claims[c.uid].error
    assert records(cfg) == [] and claim_dirs(cfg) == [] and not os.path.exists(cfg.cdi_dir)


def test_socket_replaced_under_the_plugin_is_noticed(cfg: Settings, plugin: Plugin) -> None:
    assert plugin.server.alive()
    os.unlink(cfg.registration_socket)
    assert not plugin.server.alive()


def test_unprepare_during_a_prepare_of_the_claim_waits_for_it(
    cfg: Settings, kube: kubeapi.KubeAPI, plugin: Plugin, kubelet: DRAKubelet, claims: Claims
) -> None:
    """Claims are read and made outside the driver's lock; an unprepare of a claim whose prepare
    is in flight waits for it, then undoes it: nothing of the claim is left."""
    c = claims.make({"gpu": {"memory": "2Gi"}})
    kube.latency_s = 0.5  # the read of the claim is slow
    t = threading.Thread(target=lambda: kubelet.prepare(DRIVER, [c]))
    t.start()
    deadline = 100
    while deadline and not any(m == "GET" and p.endswith(f"/resourceclaims/{c.name}") for m, p, _ in kube.requests):
        threading.Event().wait(0.02)
        deadline -= 1
    assert deadline, "the prepare did not read the claim"
    kubelet.unprepare(DRIVER, [c])
    kube.latency_s = 0
    t.join()
    assert records(cfg) == [] and claim_dirs(cfg) == [] and plugin.driver.prepared() == {}
    assert not os.path.exists(Path(cfg.cdi_dir) / f"vgpu.k8s.io-claim_{c.uid}.json")


def test_claims_files_live_in_the_run_dir(tmp_path: Path, kube: kubeapi.KubeAPI) -> None:
    """With common.run_dir (a tmpfs on a node) the claims' files go there, records and the
    checkpoint stay in the state dir; the region is sparse (a hole, read as zeros)."""
    from tests.dra_plugin.conftest import make_cfg

    cfg = make_cfg(tmp_path, run_dir=str(tmp_path / "run"))
    p = start_plugin(cfg, GPUS, kube)
    try:
        with DRAKubelet(cfg.kubelet_dir) as kubelet:
            kubelet.wait_registered(DRIVER)
            c = Claims(kube, cfg, GPUS).make({"gpu": {"memory": "6Gi", "cores": "30"}})
            kubelet.prepare(DRIVER, [c])
    finally:
        p.stop()
    d = tmp_path / "run" / "claims" / c.uid
    assert cfg.claims_dir == str(tmp_path / "run" / "claims")
    assert sorted(os.listdir(d)) == ["claim.json", "limits", "region"]
    assert oct(d.stat().st_mode & 0o777) == "0o700" and oct((d / "limits").stat().st_mode & 0o777) == "0o644"
    assert oct((d / "claim.json").stat().st_mode & 0o777) == "0o600"
    assert (d / "region").stat().st_blocks * 512 < vregion.REGION_SIZE  # sparse
    assert vregion.read_region(str(d / "region")).devices[0].memory_limit == 6 * GIB
    assert len(records(cfg)) == 1 and Path(cfg.checkpoint_path).is_file()
    assert str(tmp_path / "state") in cfg.checkpoint_path
    spec = json.loads((Path(cfg.cdi_dir) / f"vgpu.k8s.io-claim_{c.uid}.json").read_text())
    assert {m["hostPath"] for m in spec["devices"][0]["containerEdits"]["mounts"]} >= {str(d / "region")}
