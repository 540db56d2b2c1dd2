"""vgpu-monitor on MIG devices (simulated H200 in MIG mode): MIG devices observed by their MIG
UUID, the memory backstop acting on a container that exceeds its slice of a MIG instance, and
the compute shares there reported as not enforced (NVML has no per-process utilisation on MIG)."""

from __future__ import annotations

import signal

import pytest

from sim.fakegpu.mig import product
from tests.monitor.helpers import Gated, Monitors, Procs, make_container, metric
from tests.support.poll import poll as wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
GIB = 1 << 30


def test_mig_devices_backstop_and_unenforced_shares(fakegpu, tmp_path, procs: Procs) -> None:
    fakegpu.configure([product("h200-141gb", mig_mode=1, context_overhead=0)])
    big, small = fakegpu.mig_create(0, "3g.71gb", "1g.18gb")
    st = tmp_path / "state"
    monitors = Monitors(st, fakegpu.env, procs)
    workers = []
    try:
        mon = monitors.start("--backstop-action", "kill", "--backstop-grace-s", "0.5")

        def spawn(cid: str, uuid: str, alloc: str, limit: int) -> Gated:
            argv = [fakegpu.burn, "--alloc", alloc, "--seconds", "0", "--hold", "60"]
            w = Gated(argv, {**fakegpu.env, "CUDA_VISIBLE_DEVICES": uuid}, procs)
            make_container(st, cid, w.pid, [(uuid, limit, 50)], pod=f"pod-{cid}", namespace="ns1")
            workers.append(w)
            w.release()
            return w

        ok = spawn("fits", small["uuid"], "512m", GIB)
        hog = spawn("hog", big["uuid"], "3g", GIB)  # no libvgpu.so: past its slice of the instance
        assert wait_for(lambda: hog.proc.poll() is not None, 20)
        assert hog.proc.returncode == -signal.SIGKILL
        assert wait_for(
            lambda: (
                metric(mon.scrape(), "vgpu_container_backstop_actions_total", container_id="hog", action="kill") == 1
            ),
            10,
        )
        assert ok.proc.poll() is None

        def mig_entries() -> dict:
            return {g["uuid"]: g for g in (mon.status() or {}).get("gpus", [])}

        assert wait_for(lambda: small["uuid"] in mig_entries(), 10)
        e = mig_entries()[small["uuid"]]
        assert e["parent"] == fakegpu.uuids[0] and e["compute_enforced"] is False
        assert e["memory_total"] == 16384 << 20
        assert [c["container_id"] for c in e["containers"]] == ["fits"]
    finally:
        monitors.stop_all()
        for w in workers:
            w.kill()
