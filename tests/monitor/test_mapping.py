"""Host pid -> container: cgroup naming (fixture files of every driver/runtime), the
hook's cgroupsPath, the process tree, region slots confined to the pid namespace."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from monitor import cgroups
from monitor.containers import Registry
from monitor.mapping import Mapper
from monitor.procs import ProcKey, nspids
from tests.monitor.helpers import Procs, key, make_container
from tests.support import regions
from tests.support.poll import poll
from vgpu.paths import Paths

pytestmark = pytest.mark.timeout(60)

DATA = Path(__file__).parent / "data" / "cgroup"
CID = "3f1e2d4c5b6a79880f1e2d4c5b6a79880f1e2d4c5b6a79880f1e2d4c5b6a7988"
POD_UID = "0b6c2a8e-4f1d-4a7b-9c3e-2d5f6a7b8c9d"
GPU = ("GPU-00000000-0000-0000-0000-000000000001", 1 << 30, 50)


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.txt")))
def test_container_id_from_cgroup(name: str) -> None:
    text = (DATA / name).read_text()
    cands = cgroups.candidates(text)
    assert CID in cands
    # the id is the deepest candidate that is not a sub-cgroup of the container
    assert cands.index(CID) <= 1
    if "kubepods" in text:
        assert cgroups.pod_uid(text) == POD_UID


def test_cgroups_path_forms() -> None:
    v2 = (DATA / "v2-systemd-containerd.txt").read_text()
    spec = f"kubepods-burstable-pod{POD_UID.replace('-', '_')}.slice:cri-containerd:{CID}"
    assert cgroups.leaf_of_spec(spec) == f"cri-containerd-{CID}.scope"
    assert cgroups.in_cgroup(v2, spec)
    assert not cgroups.in_cgroup(v2, "kubepods.slice:cri-containerd:" + "f" * 64)
    v1 = (DATA / "v1-cgroupfs.txt").read_text()
    assert cgroups.in_cgroup(v1, f"/kubepods/besteffort/pod{POD_UID}/{CID}")
    assert not cgroups.in_cgroup(v1, f"/kubepods/besteffort/pod{POD_UID}/other")
    assert not cgroups.in_cgroup(v1, "")
    assert cgroups.candidates("garbage\n::\n1:x:relative\n") == []


def _fake_proc(root: Path, pid: int, ppid: int, start: int, cgroup: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    fields = ["S", str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 5
    (d / "stat").write_text(f"{pid} (gpu job) " + " ".join(fields) + "\n")
    (d / "cgroup").write_text(cgroup)
    (d / "status").write_text(f"Name:\tjob\nNSpid:\t{pid}\t7\n")


@pytest.mark.parametrize("name", ["v2-systemd-containerd.txt", "v1-cgroupfs.txt", "v2-crio.txt", "v2-nested.txt"])
def test_mapper_uses_cgroup_of_a_process(tmp_path: Path, name: str) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 4242, 1, 777, (DATA / name).read_text())
    _fake_proc(proc, 4343, 1, 778, "0::/system.slice/sshd.service\n")
    state = tmp_path / "state"
    make_container(state, CID, 999999, [GPU], region=False)
    reg = Registry(Paths(str(state)))
    containers = reg.scan()
    m = Mapper(str(proc))
    k = m.key(4242)
    assert k == ProcKey(4242, 777)
    assert m.resolve(k, containers) == CID
    k2 = m.key(4343)
    assert k2 is not None and m.resolve(k2, containers) is None


def test_mapper_uses_recorded_cgroup_path(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _fake_proc(proc, 5000, 1, 1, "0::/mygroup/job-a\n")
    state = tmp_path / "state"
    make_container(state, "ctr-a", 999999, [GPU], cgroup_path="/mygroup/job-a", region=False)
    make_container(state, "ctr-b", 999998, [GPU], cgroup_path="/mygroup/job-b", region=False)
    containers = Registry(Paths(str(state))).scan()
    k = Mapper(str(proc)).key(5000)
    assert k is not None and Mapper(str(proc)).resolve(k, containers) == "ctr-a"


def test_mapper_process_tree_and_pid_reuse(tmp_path: Path, procs: Procs) -> None:
    init = procs.spawn(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    assert poll(lambda: len(_children(init.pid)) == 2, 5)
    other = procs.spawn(["sleep", "60"])
    state = tmp_path / "state"
    make_container(state, "tree", init.pid, [GPU], region=False)
    containers = Registry(Paths(str(state))).scan()
    m = Mapper()
    for child in _children(init.pid):
        assert m.resolve(key(child), containers) == "tree"
    assert m.resolve(key(init.pid), containers) == "tree"
    assert m.resolve(key(other.pid), containers) is None
    # metadata naming an older process that had the init's pid: no match
    make_container(state, "tree", init.pid, [GPU], region=False)
    meta_path = state / "containers" / "tree" / "metadata.json"
    meta_path.write_text(
        meta_path.read_text().replace(f'"init_start_time":{key(init.pid).start_time}', '"init_start_time":1')
    )
    containers = Registry(Paths(str(state))).scan()
    assert Mapper().resolve(key(_children(init.pid)[0]), containers) is None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _claim_slot(region_path: Path, index: int, pid: int, host_pid: int, start: int) -> None:
    regions.claim_slot(region_path, index, pid, host_pid, start)


def test_mapper_region_slot_in_same_pid_namespace(tmp_path: Path, procs: Procs) -> None:
    init = procs.spawn(["sleep", "60"])
    worker = procs.spawn(["sleep", "60"])  # not a descendant of init
    state = tmp_path / "state"
    d = make_container(state, "slotted", init.pid, [GPU])
    wk = key(worker.pid)
    ns = nspids(worker.pid)
    assert ns
    _claim_slot(d / "region", 3, ns[-1], 0, wk.start_time)
    reg = Registry(Paths(str(state)))
    containers = reg.scan()
    assert reg.read_region(containers["slotted"]) is not None
    assert Mapper().resolve(wk, containers) == "slotted"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_region_cannot_claim_a_process_outside_its_pid_namespace(tmp_path: Path, procs: Procs) -> None:
    # the "container": init in a new pid namespace
    outer = procs.spawn(["unshare", "--pid", "--fork", "sleep", "60"], stderr=subprocess.DEVNULL)
    if not poll(lambda: len(_children(outer.pid)) == 1 or outer.poll() is not None, 5) or outer.poll() is not None:
        pytest.skip("cannot create a pid namespace here")
    init_pid = _children(outer.pid)[0]
    procs.adopt(init_pid)
    assert (nspids(init_pid) or [])[-1] == 1
    victim = procs.spawn(["sleep", "60"])  # a host process the container wants to get throttled/killed
    state = tmp_path / "state"
    d = make_container(state, "evil", init_pid, [GPU])
    vk = key(victim.pid)
    _claim_slot(d / "region", 0, victim.pid, victim.pid, vk.start_time)
    _claim_slot(d / "region", 1, vk.pid, 0, vk.start_time)
    reg = Registry(Paths(str(state)))
    containers = reg.scan()
    assert reg.read_region(containers["evil"]) is not None
    assert Mapper().resolve(vk, containers) is None
    # ...while the container's own init is still its own
    assert Mapper().resolve(key(init_pid), containers) == "evil"


def test_registry_sees_rewritten_metadata(tmp_path: Path, procs: Procs) -> None:
    a = procs.spawn(["sleep", "60"])
    b = procs.spawn(["sleep", "60"])
    state = tmp_path / "state"
    make_container(state, "reused", a.pid, [GPU])
    reg = Registry(Paths(str(state)))
    c = reg.scan()["reused"]
    assert c.metadata is not None and c.metadata.init_pid == a.pid
    make_container(state, "reused", b.pid, [GPU])  # same id, new container (written by rename)
    c = reg.scan()["reused"]
    assert c.metadata is not None and c.metadata.init_pid == b.pid
