"""Fixtures of the DRA plugin tests: a DRA config under tmp_path, simulated GPU inventories,
the API server stand-in taught the resource.k8s.io/v1 kinds."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_plugin.config import Settings, settings
from sim import kubeapi
from vgpu.nvml import GPUInfo

NODE = "node-1"
GIB = 1 << 30


def gpus(n: int = 2, memory: int = 16 * GIB) -> list[GPUInfo]:
    return [
        GPUInfo(
            index=i,
            uuid=f"GPU-{i:08x}-1111-2222-3333-444444444444",
            name="NVIDIA Fake GPU",
            memory_total=memory,
            numa_node=0,
            pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",
            cc_major=8,
            cc_minor=0,
            driver_version="580.65.06",
            cuda_driver_version=12080,
        )
        for i in range(n)
    ]


def make_cfg(tmp_path: Path, **kw: object) -> Settings:
    lib = tmp_path / "libvgpu.so"
    if not lib.exists():
        lib.write_bytes(b"\x7fELF placeholder")
    # Unix socket paths are limited to 107 bytes: the kubelet dir goes under a short name
    # (a link in /tmp to the test's own directory, removed with it).
    (tmp_path / "kubelet").mkdir(exist_ok=True)
    short = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    os.rmdir(short)
    os.symlink(tmp_path / "kubelet", short)
    _LINKS.append(short)
    base: dict[str, object] = {
        "node_name": NODE,
        "kubelet_dir": str(short),
        "state_dir": str(tmp_path / "state"),
        "cdi_dir": str(tmp_path / "cdi"),
        "library_path": str(lib),
    }
    base.update(kw)
    return settings(None, **base)


_LINKS: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_links() -> Iterator[None]:
    yield
    while _LINKS:
        _LINKS.pop().unlink(missing_ok=True)


@pytest.fixture
def cfg(tmp_path: Path) -> Settings:
    return make_cfg(tmp_path)


@pytest.fixture
def kube() -> Iterator[kubeapi.KubeAPI]:
    """The API server stand-in (it knows the resource.k8s.io/v1 kinds and their scopes)."""
    with kubeapi.running() as api:
        api.create("nodes", kubeapi.node_object(NODE))
        yield api
