"""The node's GPUs as the DRA plugin publishes them.

`vgpu.nvml.GPUInfo` has what the device plugin needs (index, UUID, name, memory, PCI bus, NUMA);
ResourceSlice attributes also want the compute capability and the driver versions, read here
through the same NVML (phase 2 folds them into GPUInfo, the node core's inventory).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vgpu import nvml

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPU:
    index: int
    uuid: str
    product_name: str
    memory_total: int
    numa_node: int | None = None
    pci_bus_id: str | None = None
    cc_major: int | None = None
    cc_minor: int | None = None
    driver_version: str | None = None  # NVML's text, e.g. "580.65.06"
    cuda_driver_version: int | None = None  # NVML's number, e.g. 12080
    healthy: bool = True


def from_info(info: nvml.GPUInfo, **extra: Any) -> GPU:
    return GPU(
        index=info.index,
        uuid=info.uuid,
        product_name=info.name,
        memory_total=info.memory_total,
        numa_node=info.numa_node,
        pci_bus_id=info.pci_bus_id,
        **extra,
    )


def read() -> list[GPU]:
    """All GPUs NVML reports (NVML must be initialised), with the DRA attributes."""
    import pynvml

    def opt(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError as e:  # NOT_SUPPORTED on old drivers and the simulator's gaps
            log.debug("%s: %s", getattr(fn, "__name__", fn), e)
            return None

    driver = opt(pynvml.nvmlSystemGetDriverVersion)
    cuda = opt(pynvml.nvmlSystemGetCudaDriverVersion)
    out = []
    for info in nvml.inventory():
        h = pynvml.nvmlDeviceGetHandleByIndex(info.index)
        cc = opt(pynvml.nvmlDeviceGetCudaComputeCapability, h)
        out.append(
            from_info(
                info,
                cc_major=int(cc[0]) if cc else None,
                cc_minor=int(cc[1]) if cc else None,
                driver_version=driver.decode() if isinstance(driver, bytes) else driver,
                cuda_driver_version=int(cuda) if cuda is not None else None,
            )
        )
    return out


def with_health(gpus: Sequence[GPU], unhealthy: set[str]) -> list[GPU]:
    return [replace(g, healthy=g.uuid not in unhealthy) for g in gpus]
