"""Shared NVML helpers (device plugin, monitor).

- `init()`: nvmlInit with retry and exponential backoff (the driver may not be
  ready yet when a daemon starts at boot).
- `inventory()`: the GPUs as `GPUInfo` (index, UUID, name, memory, PCI bus id,
  NUMA node read from sysfs `<sysfs_root>/bus/pci/devices/<busid>/numa_node`, CUDA compute
  capability, driver and CUDA driver versions): the node core's inventory, which both front ends
  publish (the device plugin's node annotation, the DRA plugin's ResourceSlice attributes).
  The sysfs root defaults to `$VGPU_SYSFS_ROOT`, else `/sys`, so tests can
  point it at a directory of their own.
- `XidWatcher`: waits for XID critical-error events on a set of devices.
- `device_lost()`: whether NVML reports a GPU as lost.

pynvml is imported lazily so that importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SYSFS_ROOT_ENV = "VGPU_SYSFS_ROOT"

# XIDs caused by applications, not by the GPU (NVIDIA's device plugin ignores
# the same set): 13 graphics engine exception, 31 MMU fault, 43 reset channel
# verification, 45 preemptive cleanup, 68 video processor exception, 109 context
# switch timeout.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class NVMLUnavailable(RuntimeError):
    """NVML could not be initialised (no driver, no library)."""


def _pynvml() -> Any:
    import pynvml

    return pynvml


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def init(
    *,
    attempts: int = 5,
    initial_delay: float = 0.5,
    max_delay: float = 8.0,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """nvmlInit, retried `attempts` times with exponential backoff.

    Raises NVMLUnavailable naming the last error when every attempt failed.
    """
    pynvml = _pynvml()
    delay = initial_delay
    last: Exception | None = None
    for attempt in range(1, max(1, attempts) + 1):
        try:
            pynvml.nvmlInit()
            if attempt > 1:
                log.info("NVML initialised after %d attempts", attempt)
            return
        except pynvml.NVMLError as e:  # library missing, driver not loaded, ...
            last = e
            if attempt < attempts:
                log.warning("NVML init failed (%s), retrying in %.1fs", e, delay)
                sleep(delay)
                delay = min(delay * 2, max_delay)
    raise NVMLUnavailable(f"cannot initialise NVML: {last}")


def shutdown() -> None:
    pynvml = _pynvml()
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass


@dataclass(frozen=True)
class GPUInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    pci_bus_id: str | None
    numa_node: int | None
    # None where NVML does not say (NOT_SUPPORTED on old drivers, the simulator's gaps).
    cc_major: int | None = None
    cc_minor: int | None = None
    driver_version: str | None = None  # NVML's text, e.g. "580.65.06"
    cuda_driver_version: int | None = None  # NVML's number, e.g. 12080
    # A MIG device (nodecore/mig.py): uuid is its `MIG-...` UUID, index its GPU's NVML index,
    # memory_total its GPU instance's memory; these name the GPU and the instance.
    parent_uuid: str | None = None
    mig_gi: int | None = None
    mig_ci: int | None = None
    mig_profile: str | None = None  # e.g. "3g.71gb" (go-nvlib's name)
    mig_index: int | None = None  # nvmlDeviceGetMigDeviceHandleByIndex's index under its GPU

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None

    @property
    def root_uuid(self) -> str:
        """The physical GPU's UUID (a MIG device's parent)."""
        return self.parent_uuid or self.uuid


def sysfs_root() -> str:
    return os.environ.get(SYSFS_ROOT_ENV) or "/sys"


def normalize_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` as sysfs names it: `0000:3b:00.0`."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if sep and len(domain) > 4:
        domain = domain[-4:]
    return f"{domain}{sep}{rest}" if sep else bus_id


def numa_node(bus_id: str | None, root: str | None = None) -> int | None:
    """The NUMA node of a PCI device from sysfs; None when unknown (-1, missing, garbage)."""
    if not bus_id:
        return None
    name = normalize_bus_id(bus_id)
    if "/" in name or name in (".", ".."):
        return None
    path = os.path.join(root or sysfs_root(), "bus", "pci", "devices", name, "numa_node")
    try:
        with open(path, encoding="ascii") as f:
            value = int(f.read(32).strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return value if value >= 0 else None


def _bus_id(handle: Any) -> str | None:
    pynvml = _pynvml()
    try:
        info = pynvml.nvmlDeviceGetPciInfo(handle)
    except pynvml.NVMLError:
        try:
            info = pynvml.nvmlDeviceGetPciInfo_v2(handle)
        except pynvml.NVMLError:
            return None
    raw = getattr(info, "busId", None) or getattr(info, "busIdLegacy", None)
    return _text(raw) if raw else None


def _optional(fn: Callable[..., Any], *args: Any) -> Any:
    """An NVML query whose failure only means "unknown" (None)."""
    pynvml = _pynvml()
    try:
        return fn(*args)
    except pynvml.NVMLError as e:  # NOT_SUPPORTED on old drivers and the simulator's gaps
        log.debug("%s: %s", getattr(fn, "__name__", fn), e)
        return None


def device_info(
    index: int, root: str | None = None, driver: str | None = None, cuda_driver: int | None = None
) -> GPUInfo:
    pynvml = _pynvml()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(pynvml.nvmlDeviceGetUUID(h))
    name = _text(pynvml.nvmlDeviceGetName(h))
    mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
    bus = _bus_id(h)
    cc = _optional(pynvml.nvmlDeviceGetCudaComputeCapability, h)
    return GPUInfo(
        index=index,
        uuid=uuid,
        name=name,
        memory_total=mem,
        pci_bus_id=bus,
        numa_node=numa_node(bus, root),
        cc_major=int(cc[0]) if cc else None,
        cc_minor=int(cc[1]) if cc else None,
        driver_version=driver,
        cuda_driver_version=cuda_driver,
    )


def inventory(root: str | None = None) -> list[GPUInfo]:
    """All GPUs NVML reports, in NVML index order (NVML must be initialised)."""
    pynvml = _pynvml()
    driver = _optional(pynvml.nvmlSystemGetDriverVersion)
    cuda = _optional(pynvml.nvmlSystemGetCudaDriverVersion)
    drv = _text(driver) if driver is not None else None
    cuda_v = int(cuda) if cuda is not None else None
    return [device_info(i, root, drv, cuda_v) for i in range(pynvml.nvmlDeviceGetCount())]


def device_lost(uuid: str) -> bool:
    """True when NVML reports the GPU lost (or can no longer find it)."""
    pynvml = _pynvml()
    try:
        h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pynvml.nvmlDeviceGetMemoryInfo(h)
    except pynvml.NVMLError as e:
        code = getattr(e, "value", None)
        return code in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NOT_FOUND)
    return False


NO_INSTANCE = 0xFFFFFFFF


@dataclass(frozen=True)
class XidEvent:
    uuid: str | None
    xid: int
    # nvmlEventData_t: the MIG instance the XID is attributed to, None when the whole GPU
    # (0xFFFFFFFF); events come on the GPU's handle ("This API does not currently support
    # per-instance event reporting using MIG device handles", nvml.h).
    gi: int | None = None
    ci: int | None = None


class EventsUnsupported(RuntimeError):
    """The driver does not support XID event registration for any device."""


class XidWatcher:
    """Waits for XID critical-error events of the given devices.

    `wait(timeout_ms)` returns an XidEvent, or None on timeout. Devices whose
    registration is refused (NOT_SUPPORTED) are skipped with a log line; when
    none can be registered EventsUnsupported is raised.
    """

    def __init__(self, uuids: Iterable[str]) -> None:
        pynvml = _pynvml()
        self._pynvml = pynvml
        self._set = pynvml.nvmlEventSetCreate()
        self.registered: list[str] = []
        try:
            for uuid in uuids:
                try:
                    h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self._set)
                    self.registered.append(uuid)
                except pynvml.NVMLError as e:
                    log.warning("cannot register XID events for %s: %s", uuid, e)
            if not self.registered:
                raise EventsUnsupported("no device accepts XID event registration")
        except BaseException:
            self.close()
            raise

    def wait(self, timeout_ms: int) -> XidEvent | None:
        pynvml = self._pynvml
        try:
            data = pynvml.nvmlEventSetWait_v2(self._set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return None
        uuid: str | None
        try:
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        except pynvml.NVMLError:
            uuid = None
        gi = int(getattr(data, "gpuInstanceId", NO_INSTANCE))
        ci = int(getattr(data, "computeInstanceId", NO_INSTANCE))
        return XidEvent(
            uuid=uuid,
            xid=int(data.eventData),
            gi=None if gi == NO_INSTANCE else gi,
            ci=None if ci == NO_INSTANCE else ci,
        )

    def close(self) -> None:
        if self._set is not None:
            try:
                self._pynvml.nvmlEventSetFree(self._set)
            except self._pynvml.NVMLError:
                pass
            self._set = None

    def __enter__(self) -> XidWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
