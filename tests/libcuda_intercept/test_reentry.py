"""Re-entrancy: a driver that calls its own exported API from inside an entry
point, and from a thread of its own, reaches the hooks again
(build/intercept/reenter/libcuda.so.1, see tests/libcuda_intercept/c/reenter_driver.c)."""

from __future__ import annotations

from tests.libcuda_intercept.support import BUILD, FAKE, MiB, Node


def _env(node: Node) -> dict[str, str]:
    return {
        "LD_LIBRARY_PATH": f"{BUILD / 'intercept' / 'reenter'}:{FAKE}",
        "REENTER_REAL": str(FAKE / "libcuda.so.1"),
    }


def test_hook_inside_hook_is_charged_once(node: Node) -> None:
    node.limit(8 * MiB)
    # the driver's pitch allocation is made with the exported cuMemAlloc_v2 (-> the hook again)
    r = node.cutest("gpa", "init", "pitch", 1000, 1024, "info", "free", 0, "info", env=_env(node))
    assert r.rc == 0, r.err
    pitch = int(r.one("pitch")["pitch"])
    assert r.one("pitch")["rc"] == "0" and pitch == 1024
    assert int(r.one("info", 0)["free"]) == 8 * MiB - pitch * 1024  # once, not twice
    assert int(r.one("info", 1)["free"]) == 8 * MiB


def test_hooks_from_a_driver_thread_while_a_hook_runs(node: Node) -> None:
    node.limit(9 * MiB)  # room for the driver thread's 4 KiB next to the outer charge
    # each cuMemAlloc_v2 of >= 8 KiB runs a driver thread that calls cuMemGetInfo_v2,
    # cuMemAlloc_v2 and cuMemFree_v2 through the hooks and waits for it
    r = node.cutest(
        "gpa",
        "init",
        "alloc",
        MiB,
        "alloc",
        7 * MiB,
        "alloc",
        2 * MiB,
        "info",
        "freeall",
        "info",
        "threads",
        4,
        20,
        64 << 10,
        "info",
        env=_env(node),
        timeout=120,
    )
    assert r.rc == 0, r.err
    a = r.all("alloc")
    assert a[0]["rc"] == "0" and a[1]["rc"] == "0" and a[2]["rc"] == "2", r.out
    assert r.one("info", 0)["free"] == str(MiB)
    assert r.one("info", 1)["free"] == str(9 * MiB)
    assert r.one("threads")["fails"] == "0"
    assert r.one("info", 2)["free"] == str(9 * MiB)
