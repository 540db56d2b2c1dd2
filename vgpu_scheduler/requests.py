"""What a pod asks for: per-container vGPU requests and the pod's placement options (pure).

Resource semantics (docs/operators/scheduling.md, "Resources"):
- `nvidia.com/gpu: N` — N distinct physical GPUs; each GPU gets the memory and cores below.
- `nvidia.com/gpumem: M` — M MiB on each of the N GPUs; `nvidia.com/gpumem-percentage: P` —
  P % of each GPU's schedulable memory (exclusive with gpumem).
- `nvidia.com/gpucores: C` — C % of each GPU's compute.
- Neither memory resource: the configured default (default: the GPU's 1/K slice); no gpucores:
  the configured default (default: the GPU's 1/K of its cores).
Quantities are Kubernetes quantities (vgpu/quantity.py: "3k", "4096", "1e3" as the API server
stores them) that must be whole numbers; limits win over requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vgpu import quantity
from vgpu import scheduling as sc

_UUID = re.compile(r"^[A-Za-z0-9-]{1,95}$")
_TRUE = {"true", "1", "yes", "t"}
_FALSE = {"false", "0", "no", "f"}


class RequestError(ValueError):
    """A pod's vGPU request or annotation that cannot be honoured; the message says why."""


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    name: str
    init: bool
    count: int  # distinct GPUs
    mem_mib: int | None  # nvidia.com/gpumem
    mem_pct: int | None  # nvidia.com/gpumem-percentage
    cores: int | None  # nvidia.com/gpucores


@dataclass(frozen=True, slots=True)
class PodOptions:
    node_policy: str
    gpu_policy: str
    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()
    numa_bind: bool = False
    mig: bool = False  # vgpu.k8s.io/mig: a MIG instance per container (vgpu_scheduler/mig.py)


def _resources(c: dict[str, Any]) -> dict[str, Any]:
    res = c.get("resources") or {}
    out = dict(res.get("requests") or {})
    out.update(res.get("limits") or {})
    return out


def _quantity(cname: str, key: str, value: Any) -> int:
    """The whole number `value` stands for. The API server writes 3000 as "3k" and keeps "4096"
    and "1e3" (tests/data/real-traces/quantities): read it as it does (vgpu/quantity.py). The one
    error text of the webhook and the extender: `container c: nvidia.com/gpumem='500m' is not a
    whole number`."""
    try:
        return quantity.whole(value)
    except quantity.QuantityError as e:
        shown = value if isinstance(value, str) else str(value)
        raise RequestError(f"container {cname}: {key}={shown!r} {e}") from None


def asks_vgpu(c: dict[str, Any], resource: str = sc.RESOURCE_GPU) -> bool:
    res = _resources(c)
    keys = (resource, sc.RESOURCE_MEM, sc.RESOURCE_MEM_PERCENT, sc.RESOURCE_CORES)
    return any(k in res for k in keys)


def wants_vgpu(pod: dict[str, Any], resource: str = sc.RESOURCE_GPU) -> bool:
    spec = pod.get("spec") or {}
    return any(asks_vgpu(c, resource) for c in (spec.get("initContainers") or []) + (spec.get("containers") or []))


def container_request(c: dict[str, Any], init: bool, resource: str = sc.RESOURCE_GPU) -> ContainerRequest | None:
    """The container's request, None when it asks for no vGPU resource; RequestError when invalid."""
    name = str(c.get("name") or "")
    res = _resources(c)
    if not any(k in res for k in (resource, sc.RESOURCE_MEM, sc.RESOURCE_MEM_PERCENT, sc.RESOURCE_CORES)):
        return None
    if resource not in res:
        raise RequestError(f"container {name}: {sc.RESOURCE_MEM}/{sc.RESOURCE_CORES} given without {resource}")
    count = _quantity(name, resource, res[resource])
    if count < 1:
        if any(k in res for k in (sc.RESOURCE_MEM, sc.RESOURCE_MEM_PERCENT, sc.RESOURCE_CORES)):
            raise RequestError(f"container {name}: {resource}=0 with memory or cores asked")
        return None
    mem = _quantity(name, sc.RESOURCE_MEM, res[sc.RESOURCE_MEM]) if sc.RESOURCE_MEM in res else None
    pct = (
        _quantity(name, sc.RESOURCE_MEM_PERCENT, res[sc.RESOURCE_MEM_PERCENT])
        if sc.RESOURCE_MEM_PERCENT in res
        else None
    )
    cores = _quantity(name, sc.RESOURCE_CORES, res[sc.RESOURCE_CORES]) if sc.RESOURCE_CORES in res else None
    if mem is not None and pct is not None:
        raise RequestError(f"container {name}: {sc.RESOURCE_MEM} and {sc.RESOURCE_MEM_PERCENT} are exclusive")
    if mem is not None and mem < 1:
        raise RequestError(f"container {name}: {sc.RESOURCE_MEM}={mem}: at least 1 MiB")
    if pct is not None and not 1 <= pct <= 100:
        raise RequestError(f"container {name}: {sc.RESOURCE_MEM_PERCENT}={pct}: must be 1..100")
    if cores is not None and not 0 <= cores <= 100:
        raise RequestError(f"container {name}: {sc.RESOURCE_CORES}={cores}: must be 0..100")
    return ContainerRequest(name, init, count, mem, pct, cores)


def container_requests(pod: dict[str, Any], resource: str = sc.RESOURCE_GPU) -> list[ContainerRequest]:
    """Every vGPU container of the pod: init containers first, then app containers, in spec order."""
    spec = pod.get("spec") or {}
    out: list[ContainerRequest] = []
    for init, key in ((True, "initContainers"), (False, "containers")):
        for c in spec.get(key) or []:
            r = container_request(c, init, resource)
            if r is not None:
                out.append(r)
    names = [r.name for r in out]
    if len(set(names)) != len(names) or "" in names:
        raise RequestError("containers need distinct, non-empty names")
    return out


def _list(value: str, key: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in value.split(","))
    if not value.strip() or any(not s for s in items):
        raise RequestError(f"{key}={value!r}: a comma list of non-empty items")
    return items


def pod_options(annotations: dict[str, str] | None, node_policy: str, gpu_policy: str) -> PodOptions:
    """The pod's placement options from its annotations (ours or HAMi's spellings); invalid → RequestError."""
    a = annotations or {}

    def policy(key: str, default: str) -> str:
        v = sc.annotation(a, key)
        if v is None:
            return default
        if v.strip() not in sc.POLICIES:
            raise RequestError(f"{key}={v!r}: must be one of {', '.join(sc.POLICIES)}")
        return v.strip()

    def types(key: str) -> tuple[str, ...]:
        v = sc.annotation(a, key)
        return tuple(s.lower() for s in _list(v, key)) if v is not None else ()

    def uuids(key: str) -> frozenset[str]:
        v = sc.annotation(a, key)
        if v is None:
            return frozenset()
        items = _list(v, key)
        for u in items:
            if not _UUID.match(u):
                raise RequestError(f"{key}: {u!r} is not a GPU UUID")
        return frozenset(items)

    def flag(key: str) -> bool:
        v = sc.annotation(a, key)
        if v is None:
            return False
        n = v.strip().lower()
        if n not in _TRUE | _FALSE:
            raise RequestError(f"{key}={v!r}: must be true or false")
        return n in _TRUE

    numa_bind = flag(sc.NUMA_BIND_ANNOTATION)
    mig = flag(sc.MIG_ANNOTATION)
    return PodOptions(
        node_policy=policy(sc.NODE_POLICY_ANNOTATION, node_policy),
        gpu_policy=policy(sc.GPU_POLICY_ANNOTATION, gpu_policy),
        use_types=types(sc.USE_GPUTYPE_ANNOTATION),
        nouse_types=types(sc.NOUSE_GPUTYPE_ANNOTATION),
        use_uuids=uuids(sc.USE_GPUUUID_ANNOTATION),
        nouse_uuids=uuids(sc.NOUSE_GPUUUID_ANNOTATION),
        numa_bind=numa_bind,
        mig=mig,
    )
