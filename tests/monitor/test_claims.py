"""DRA claims as the monitor sees them: the claim directories the DRA plugin makes (its own
ClaimState writer), real processes mapped to a claim by the region the runtime gave them (mapped by
our library, or mounted at /run/vgpu/region in the process's root), and the monitor on the
simulated GPU holding a claim to its `cores` and its memory, with the claim named in the metrics
and in `vgpuctl status`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_plugin.claimstate import ClaimState, new_metadata
from monitor.containers import Registry
from monitor.mapping import Mapper
from tests.monitor.helpers import Monitors, Procs, exec_ns, key, make_container, metric, state
from tests.support.poll import poll
from vgpu import schemas
from vgpu.paths import Paths
from vgpuctl import cli as ctl

GIB = 1 << 30
U0 = "GPU-00000000-0000-0000-0000-00000000000a"
UID_A = "0b6b3c52-7f0e-4d8e-9a51-1c2d3e4f5a6b"
UID_B = "9f8e7d6c-5b4a-4392-8170-a1b2c3d4e5f6"

# A process that maps a file the way our library maps its region (MAP_SHARED), then waits.
MAPPER = (
    "import mmap,sys,time; f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),0); "
    "print('ok',flush=True); time.sleep(120)"
)


def make_claim(
    paths: Paths,
    uid: str,
    gpus: list[tuple[str, int, int]],
    *,
    name: str = "shared-gpu",
    namespace: str = "team1",
    pods: tuple[str, ...] = ("trainer-0", "trainer-1"),
) -> Path:
    """A prepared claim's directory, written by the DRA plugin's own ClaimState."""
    rec = schemas.AllocationRecord(
        token=uid.replace("-", ""),
        created=time.time(),
        resource_name="gpu.vgpu.k8s.io",
        gpus=[schemas.AllocatedGPU(uuid=u, memory_limit=m, core_percent=c) for u, m, c in gpus],
    )
    devices = [
        schemas.ClaimDevice(request="gpu", pool="node-1", device=f"gpu-{i}", uuid=u, memory=m, cores=c)
        for i, (u, m, c) in enumerate(gpus)
    ]
    meta = new_metadata(
        claim_uid=uid,
        namespace=namespace,
        name=name,
        rec=rec,
        driver="gpu.vgpu.k8s.io",
        devices=devices,
        reserved_for=[schemas.PodRef(name=p, uid=f"uid-{p}") for p in pods],
    )
    cs = ClaimState(paths)
    cs.ensure_dir()
    cs.create_new(rec, meta)
    return Path(cs.path(uid))


def spawn_mapper(procs: Procs, path: Path) -> subprocess.Popen:
    p = procs.spawn([sys.executable, "-c", MAPPER, str(path)], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
    return p


def in_claim_root(region: Path, argv: list[str]) -> list[str]:
    """argv run as a DRA container's process sees its claim: a mount namespace of its own where
    /run/vgpu/region is the claim's region (what the CDI mount of the claim does), without our
    library (a static binary, or one that bypasses it)."""
    script = (
        "mount -t tmpfs -o mode=755 tmpfs /run && mkdir /run/vgpu && : > /run/vgpu/region"
        ' && mount --bind "$0" /run/vgpu/region && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(region), *argv]


def can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return r.returncode == 0


def test_registry_lists_prepared_claims_only(tmp_path: Path) -> None:
    paths = Paths(str(tmp_path / "state"), str(tmp_path / "run"))
    make_claim(paths, UID_A, [(U0, 6 * GIB, 30)])
    half = Path(paths.claims_dir) / UID_B
    half.mkdir()  # being made: no claim.json yet
    (half / "limits").write_text("vgpu-limits 1\n")
    (Path(paths.claims_dir) / "not-a-uid").mkdir()
    os.symlink(str(tmp_path), str(Path(paths.claims_dir) / "00000000-0000-4000-8000-000000000000"))
    found = Registry(paths).scan()
    assert list(found) == ["claim:" + UID_A]
    c = found["claim:" + UID_A]
    assert c.kind == "claim"
    assert c.labels() == {
        "container_id": "claim:" + UID_A,
        "namespace": "team1",
        "pod": "trainer-0,trainer-1",
        "container": "",
        "claim": "shared-gpu",
    }
    assert c.memory_limit(U0) == 6 * GIB and c.share(U0) == 30.0
    # unprepared: the plugin removed the directory, the claim leaves the registry
    ClaimState(paths).remove(UID_A)
    assert Registry(paths).scan() == {}


def test_processes_mapped_to_their_claim_by_its_region(tmp_path: Path, procs: Procs) -> None:
    paths = Paths(str(tmp_path / "state"))
    da = make_claim(paths, UID_A, [(U0, 6 * GIB, 30)])
    make_claim(paths, UID_B, [(U0, 4 * GIB, 20)], name="other")
    # two pods' containers using claim A: our library maps the region it was given
    a1 = spawn_mapper(procs, da / "region")
    a2 = spawn_mapper(procs, da / "region")
    # a process mapping a copy of claim A's region (same bytes, another file): not claim A's
    copy = tmp_path / "copy"
    shutil.copy(da / "region", copy)
    forger = spawn_mapper(procs, copy)
    bystander = procs.spawn(["sleep", "60"])
    reg = Registry(paths)
    found = reg.scan()
    m = Mapper()
    assert m.resolve(key(a1.pid), found) == "claim:" + UID_A
    assert m.resolve(key(a2.pid), found) == "claim:" + UID_A
    assert m.resolve(key(forger.pid), found) is None
    assert m.resolve(key(bystander.pid), found) is None


@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare(1) for a mount namespace")
def test_process_mapped_by_the_region_in_its_root(tmp_path: Path, procs: Procs) -> None:
    """A container's process that never maps the region (bypassing the library) is still its
    claim's: the runtime mounted the claim's region at /run/vgpu/region in its root."""
    paths = Paths(str(tmp_path / "state"))
    da = make_claim(paths, UID_A, [(U0, 6 * GIB, 30)])
    db = make_claim(paths, UID_B, [(U0, 4 * GIB, 20)], name="other")
    pa = procs.spawn(in_claim_root(da / "region", ["sleep", "60"]))
    pb = procs.spawn(in_claim_root(db / "region", ["sleep", "60"]))
    # a link to claim A's region at that place does not count: only the regular file itself
    link = procs.spawn(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs tmpfs /run && mkdir /run/vgpu && ln -s "$0" /run/vgpu/region && exec sleep 60',
            str(da / "region"),
        ]
    )
    for p in (pa, pb, link):
        assert poll(lambda p=p: os.readlink(f"/proc/{p.pid}/exe").endswith("/sleep"), 10)
    found = Registry(paths).scan()
    m = Mapper()
    assert m.resolve(key(pa.pid), found) == "claim:" + UID_A
    assert m.resolve(key(pb.pid), found) == "claim:" + UID_B
    assert m.resolve(key(link.pid), found) is None


# -- the monitor on the simulated GPU --------------------------------------------------------


@pytest.fixture
def node(fakegpu, tmp_path: Path, procs: Procs, build_dir: Path) -> Iterator:
    st = tmp_path / "state"
    paths = Paths(str(st))
    monitors = Monitors(st, fakegpu.env, procs)

    def lib_env(claim_dir: Path) -> dict[str, str]:
        """A claim's container: our library preloaded, its limits and region (in a container the
        CDI mounts put them at /run/vgpu/; the library takes these paths from the environment)."""
        env = {k: v for k, v in fakegpu.env.items() if not k.startswith(("VGPU_", "LD_PRELOAD"))}
        env.update(
            LD_PRELOAD=str(build_dir / "libvgpu.so"),
            VGPU_LIMITS_FILE=str(claim_dir / "limits"),
            VGPU_REGION_FILE=str(claim_dir / "region"),
        )
        return env

    try:
        yield fakegpu, paths, monitors.start, lib_env
    finally:
        monitors.stop_all()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_claim_held_to_its_cores_and_named_in_metrics_and_vgpuctl(node, procs: Procs, capsys) -> None:
    fakegpu, paths, start_monitor, lib_env = node
    u0 = fakegpu.uuids[0]
    da = make_claim(paths, UID_A, [(u0, 4 * GIB, 20)])
    burn = [fakegpu.burn, "--kernel-us", "100", "--seconds", "60"]
    # two pods' containers share claim A (20 %); a device-plugin container has 80 %
    a1 = procs.spawn(burn, env=lib_env(da), stdout=subprocess.DEVNULL)
    a2 = procs.spawn(burn, env=lib_env(da), stdout=subprocess.DEVNULL)
    other = procs.spawn(burn, env=fakegpu.env, stdout=subprocess.DEVNULL)
    make_container(Path(paths.state_dir), "plugin-ctr", other.pid, [(u0, 8 * GIB, 80)], pod="p", namespace="ns2")
    mon = start_monitor("--policy", "strict")
    assert poll(lambda: state(a1.pid) == "T" or state(a2.pid) == "T", 15)
    cid = "claim:" + UID_A
    lab = {"container_id": cid, "namespace": "team1", "pod": "trainer-0,trainer-1", "claim": "shared-gpu"}
    assert poll(lambda: metric(mon.scrape(), "vgpu_container_sm_share_percent", **lab, gpu="0") == 20, 10)
    text = mon.scrape()
    assert metric(text, "vgpu_container_memory_limit_bytes", **lab, gpu="0") == 4 * GIB
    assert poll(lambda: (metric(mon.scrape(), "vgpu_container_suspensions_total", **lab) or 0) >= 1, 10)
    # the device-plugin container's series carry no claim
    assert metric(text, "vgpu_container_sm_share_percent", container_id="plugin-ctr", pod="p", gpu="0") == 80
    assert metric(text, "vgpu_container_sm_share_percent", container_id="plugin-ctr", claim="", gpu="0") == 80
    # the claim's two processes together get about its 20 %, not 2 x 50 % of the GPU's rest
    time.sleep(2)
    before = exec_ns(fakegpu.state())
    t0 = time.monotonic()
    time.sleep(4)
    after = exec_ns(fakegpu.state())
    wall = (time.monotonic() - t0) * 1e9
    claim_pct = 100.0 * sum(after.get(p, 0) - before.get(p, 0) for p in (a1.pid, a2.pid)) / wall
    other_pct = 100.0 * (after.get(other.pid, 0) - before.get(other.pid, 0)) / wall
    assert claim_pct < 45 and other_pct > claim_pct, (claim_pct, other_pct)
    # status file and vgpuctl name the claim and its pods
    status = mon.status() or {}
    row = next(c for c in status["containers"] if c["container_id"] == cid)
    assert row["kind"] == "claim" and row["claim"] == "shared-gpu" and row["gpus"] == [u0]
    assert ctl.main(["status", "--state-dir", paths.state_dir]) == 0
    out = capsys.readouterr().out
    assert "team1/trainer-0,trainer-1" in out and "claim shared-gpu" in out and "/4.0" in out, out
    # unprepared (the plugin removes the directory): the claim's processes run again
    ClaimState(paths).remove(UID_A)
    assert poll(lambda: cid not in {c["container_id"] for c in (mon.status() or {}).get("containers", [])}, 10)
    assert poll(lambda: state(a1.pid) != "T" and state(a2.pid) != "T", 5)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        assert state(a1.pid) != "T" and state(a2.pid) != "T"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare(1) for a mount namespace")
def test_memory_backstop_applies_to_claims(node, procs: Procs) -> None:
    """A claim's process that bypasses the library and allocates past the claim's memory is
    killed by the backstop; one that fits is left alone."""
    fakegpu, paths, start_monitor, _lib_env = node
    u1 = fakegpu.uuids[1]
    dh = make_claim(paths, UID_A, [(u1, 1 * GIB, 50)], name="hog")
    df = make_claim(paths, UID_B, [(u1, 1 * GIB, 50)], name="fits")
    hold = ["--seconds", "0", "--hold", "60"]
    mon = start_monitor("--backstop-action", "kill", "--backstop-grace-s", "0.5")
    hog = procs.spawn(
        in_claim_root(dh / "region", [fakegpu.burn, "--device", "1", "--alloc", "2g", *hold]), env=fakegpu.env
    )
    fits = procs.spawn(
        in_claim_root(df / "region", [fakegpu.burn, "--device", "1", "--alloc", "256m", *hold]), env=fakegpu.env
    )
    assert poll(lambda: hog.poll() is not None, 20)
    assert hog.returncode == -signal.SIGKILL
    assert poll(
        lambda: (
            metric(
                mon.scrape(),
                "vgpu_container_backstop_actions_total",
                container_id="claim:" + UID_A,
                claim="hog",
                action="kill",
            )
            == 1
        ),
        10,
    )
    assert fits.poll() is None
    assert (
        metric(mon.scrape(), "vgpu_container_backstop_actions_total", container_id="claim:" + UID_B, action="kill") == 0
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare(1) for pid namespaces")
def test_extra_bytes_reach_each_slot_of_a_claim_shared_across_pid_namespaces(node, procs: Procs) -> None:
    """Two pods' containers of one claim, each the first process of its own pid namespace: both
    slots of the claim's region say pid 1 (host_pid 0: the library cannot know it). Their start
    times tell them apart, and each slot gets what NVML sees beyond its own charge."""
    from vgpu import region as vregion

    fakegpu, paths, start_monitor, lib_env = node
    u0 = fakegpu.uuids[0]
    da = make_claim(paths, UID_A, [(u0, 4 * GIB, 50)])
    argv = ["unshare", "--pid", "--fork", fakegpu.burn, "--alloc", "256m", "--seconds", "0", "--hold", "60"]

    def slots() -> list:
        return [s for s in vregion.read_region(str(da / "region")).slots if s.pid]

    outer = []
    for n in (1, 2):  # one after the other: start times (clock ticks) that differ
        outer.append(procs.spawn(argv, env=lib_env(da), stdout=subprocess.DEVNULL))
        assert poll(lambda n=n: len(slots()) == n, 20), slots()
        time.sleep(0.05)
    assert [s.pid for s in slots()] == [1, 1] and all(s.host_pid == 0 for s in slots())
    for p in outer:  # the workloads (pid 1 inside) are the unshare processes' children
        for c in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split():
            procs.adopt(int(c))
    start_monitor("--policy", "off")
    assert poll(lambda: all(s.extra_bytes[0] > 0 for s in slots()), 20), slots()
    used = {p["host_pid"]: p["devices"][0]["used"] for p in fakegpu.state()["processes"]}
    starts = {key(pid).start_time: pid for pid in used}
    for s in slots():
        assert s.extra_bytes[0] == used[starts[s.start_time]] - s.device_bytes[0]
