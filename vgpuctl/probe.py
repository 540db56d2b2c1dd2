"""`vgpuctl slice`: what this process sees of its GPUs, for a container to check its slice.

Per visible device, the CUDA driver's view (`cuDeviceGetUuid`, `cuDeviceTotalMem_v2`, and
`cuMemGetInfo_v2` in a context of its own) and NVML's (`nvmlDeviceGetMemoryInfo`). Inside a vGPU
container both go through libvgpu.so, so both report the slice (docs/developers/intercept.md, "Reporting");
elsewhere they report the physical GPU. Used by the chart's `helm test` pod and by
tests/cluster: the pod asks for a size and checks that its totals are that size.

The driver library is loaded with ctypes (`libcuda.so.1`, as a CUDA program loads it): nothing
but the driver that the NVIDIA container toolkit put into the container is needed. A device or
library that fails is reported with the driver's error name, never raised.
"""

from __future__ import annotations

import ctypes

import msgspec

MiB = 1 << 20


class DeviceView(msgspec.Struct, kw_only=True):
    index: int
    uuid: str = ""
    total: int = 0  # bytes
    free: int = 0  # bytes (CUDA: cuMemGetInfo in a fresh context; NVML: memory info)
    error: str = ""


class ApiView(msgspec.Struct, kw_only=True):
    error: str = ""  # the library or its initialisation failed
    devices: list[DeviceView] = msgspec.field(default_factory=list)


class SliceView(msgspec.Struct, kw_only=True):
    cuda: ApiView
    nvml: ApiView


def _uuid_text(raw: bytes) -> str:
    """CUuuid (16 bytes) as NVML and nvidia-smi write it: GPU-8-4-4-4-12 lowercase hex."""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _cuda(library: str) -> ApiView:
    try:
        lib = ctypes.CDLL(library)
    except OSError as e:
        return ApiView(error=f"cannot load {library}: {e}")

    def name(rc: int) -> str:
        s = ctypes.c_char_p()
        try:
            if lib.cuGetErrorName(rc, ctypes.byref(s)) == 0 and s.value:
                return s.value.decode("ascii", "replace")
        except AttributeError:
            pass
        return f"CUresult {rc}"

    rc = lib.cuInit(0)
    if rc:
        return ApiView(error=f"cuInit: {name(rc)}")
    n = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(n))
    if rc:
        return ApiView(error=f"cuDeviceGetCount: {name(rc)}")
    out: list[DeviceView] = []
    for i in range(n.value):
        d = DeviceView(index=i)
        out.append(d)
        dev = ctypes.c_int()
        raw = ctypes.create_string_buffer(16)
        total = ctypes.c_size_t()
        free = ctypes.c_size_t()
        ctx = ctypes.c_void_p()
        rc = lib.cuDeviceGet(ctypes.byref(dev), i)
        if rc:
            d.error = f"cuDeviceGet: {name(rc)}"
            continue
        rc = lib.cuDeviceGetUuid(raw, dev)
        if rc:
            d.error = f"cuDeviceGetUuid: {name(rc)}"
            continue
        d.uuid = _uuid_text(raw.raw)
        rc = lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
        if rc:
            d.error = f"cuCtxCreate: {name(rc)}"
            continue
        try:
            rc = lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
            if rc:
                d.error = f"cuMemGetInfo: {name(rc)}"
            else:
                d.total, d.free = int(total.value), int(free.value)
        finally:
            lib.cuCtxDestroy_v2(ctx)
    return ApiView(devices=out)


def _nvml() -> ApiView:
    try:
        import pynvml
    except ImportError as e:
        return ApiView(error=f"pynvml: {e}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return ApiView(error=f"nvmlInit: {e}")
    out: list[DeviceView] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            d = DeviceView(index=i)
            out.append(d)
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                u = pynvml.nvmlDeviceGetUUID(h)
                d.uuid = u.decode() if isinstance(u, bytes) else str(u)
                m = pynvml.nvmlDeviceGetMemoryInfo(h)
                d.total, d.free = int(m.total), int(m.free)
            except pynvml.NVMLError as e:
                d.error = str(e)
    except pynvml.NVMLError as e:
        return ApiView(error=f"nvmlDeviceGetCount: {e}", devices=out)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return ApiView(devices=out)


def observe(library: str = "libcuda.so.1") -> SliceView:
    """Both views, CUDA first (as a CUDA program would start)."""
    return SliceView(cuda=_cuda(library), nvml=_nvml())


def check(view: SliceView, memory_mib: int | None = None, gpus: int | None = None) -> list[str]:
    """What differs from the expectation (empty: as expected). Both APIs must agree with it."""
    problems: list[str] = []
    for api, v in (("cuda", view.cuda), ("nvml", view.nvml)):
        if v.error:
            problems.append(f"{api}: {v.error}")
            continue
        if gpus is not None and len(v.devices) != gpus:
            problems.append(f"{api}: {len(v.devices)} GPU(s) visible, {gpus} expected")
        for d in v.devices:
            if d.error:
                problems.append(f"{api}: GPU {d.index}: {d.error}")
            elif memory_mib is not None and d.total != memory_mib * MiB:
                problems.append(
                    f"{api}: GPU {d.index} ({d.uuid}): total {d.total} bytes ({d.total / MiB:g} MiB), "
                    f"{memory_mib} MiB expected"
                )
    if not problems:
        cu = sorted(d.uuid for d in view.cuda.devices)
        nv = sorted(d.uuid for d in view.nvml.devices)
        if cu != nv:
            problems.append(f"CUDA sees {cu}, NVML sees {nv}")
    return problems


def encode(view: SliceView) -> str:
    return msgspec.json.encode(view).decode()
