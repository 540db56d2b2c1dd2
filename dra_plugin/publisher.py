"""Keeps the node's ResourceSlices equal to what slices.build describes.

`sync()` lists the slices of (driver, node) and compares them with the desired ones. When they
differ it bumps the pool generation past every existing slice's (a consumer only trusts the
slices of a pool's highest generation: types.go ResourcePool.Generation), deletes the slices
that are no longer wanted, patches the others (a JSON merge patch carrying
metadata.resourceVersion: a concurrent writer makes it fail with 409, and the next sync starts
over from a fresh list) and creates the missing ones. `remove()` deletes them all (uninstall).

Fields the API server drops (a feature gate turned off: without DRAConsumableCapacity it drops
`allowMultipleAllocations` and `requestPolicy`) would make every sync see a difference and
bump the generation for ever; as the helper's controller (resourceslicecontroller.go
sliceStored) the publisher remembers what the server stored for what it sent, says once what
was dropped, and leaves it at that.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dra_plugin import apiclient, slices
from dra_plugin.config import Settings
from vgpu import quantity
from vgpu.log import kv
from vgpu.nvml import GPUInfo

log = logging.getLogger(__name__)

_QUANTITY_KEYS = {"value", "default", "min", "max", "step"}


def normal(devices: Any) -> Any:
    """Devices with every quantity as an integer: "16Gi" and "17179869184" are equal."""
    if isinstance(devices, dict):
        out = {}
        for k, v in devices.items():
            if k in _QUANTITY_KEYS and isinstance(v, str):
                try:
                    out[k] = quantity.value(v)
                    continue
                except quantity.QuantityError:
                    pass
            out[k] = normal(v)
        return out
    if isinstance(devices, list):
        return [normal(v) for v in devices]
    return devices


def _generation(obj: dict[str, Any]) -> int:
    pool = (obj.get("spec") or {}).get("pool") or {}
    try:
        return max(0, int(pool.get("generation") or 0))
    except (TypeError, ValueError):
        return 0


def _spec_view(obj: dict[str, Any]) -> tuple[Any, ...]:
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    return (
        spec.get("driver"),
        spec.get("nodeName"),
        pool.get("name"),
        pool.get("resourceSliceCount"),
        normal(spec.get("devices") or []),
    )


class Publisher:
    def __init__(
        self,
        api: apiclient.ResourceAPI,
        cfg: Settings,
        node: str,
        gpus: Callable[[], Sequence[GPUInfo]],
    ) -> None:
        self.api = api
        self.cfg = cfg
        self.node = node
        self.gpus = gpus
        self.node_uid = ""
        self.generation = 0
        self._stored: dict[str, tuple[Any, Any]] = {}  # name -> (desired view, stored view)
        self._warned_dropped = False
        self._lock = threading.Lock()

    def _desired(self, generation: int) -> list[dict[str, Any]]:
        return slices.build(self.node, self.gpus(), self.cfg, generation=generation, node_uid=self.node_uid)

    def sync(self) -> bool:
        """One reconciliation; True when the API server holds the desired slices. Never raises
        ApiError (logged); raises on programming errors only."""
        with self._lock:
            try:
                return self._sync()
            except apiclient.ApiError as e:
                log.warning(kv("cannot publish ResourceSlices", node=self.node, status=e.status, error=e.message))
                return False

    def _sync(self) -> bool:
        if not self.node_uid:
            try:
                self.node_uid = self.api.node_uid(self.node)
            except apiclient.ApiError as e:
                # Without the owner reference the slices outlive a deleted Node; the kubelet
                # still wipes them when the plugin goes away.
                log.info(kv("node UID unknown, publishing without owner reference", node=self.node, error=e.message))
        existing = {o["metadata"]["name"]: o for o in self.api.list_slices(self.cfg.driver_name, self.node)}
        top = max((_generation(o) for o in existing.values()), default=0)
        desired = {o["metadata"]["name"]: o for o in self._desired(max(top, 1))}
        if self._unchanged(existing, desired, top):
            self.generation = top
            return True
        generation = top + 1
        desired = {o["metadata"]["name"]: o for o in self._desired(generation)}
        # First remove what is no longer wanted: better no device than a stale one.
        for name in existing:
            if name not in desired:
                self._delete(name)
        for name, want in desired.items():
            have = existing.get(name)
            if have is None:
                stored = self.api.create_slice(want)
            else:
                body = copy.deepcopy(want)
                body["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
                if "devices" not in body["spec"]:
                    body["spec"]["devices"] = None  # merge patch: delete the field
                stored = self.api.patch_slice(name, body)
            self._remember(name, want, stored)
        self.generation = generation
        log.info(kv("ResourceSlices published", node=self.node, generation=generation, slices=len(desired)))
        return True

    def _unchanged(self, existing: dict[str, Any], desired: dict[str, Any], top: int) -> bool:
        if set(existing) != set(desired) or top == 0:
            return False
        for name, want in desired.items():
            have = existing[name]
            if _generation(have) != top:
                return False
            want_view, have_view = _spec_view(want), _spec_view(have)
            if want_view == have_view:
                continue
            remembered = self._stored.get(name)
            if remembered is not None and remembered == (want_view, have_view):
                continue  # what the server keeps of what we sent: nothing more to do
            return False
        return True

    def _remember(self, name: str, want: dict[str, Any], stored: dict[str, Any]) -> None:
        want_view, stored_view = _spec_view(want), _spec_view(stored)
        self._stored[name] = (want_view, stored_view)
        if want_view != stored_view and not self._warned_dropped:
            self._warned_dropped = True
            dev = ((stored.get("spec") or {}).get("devices") or [{}])[0]
            why = (
                "allowMultipleAllocations was dropped: DRAConsumableCapacity is off in the API server, "
                "so each GPU is allocated whole"
                if "allowMultipleAllocations" not in dev
                else "the API server changed the devices"
            )
            log.error(kv("ResourceSlice stored differently", slice=name, reason=why))

    def _delete(self, name: str) -> None:
        try:
            self.api.delete_slice(name)
        except apiclient.ApiError as e:
            if e.status != 404:
                raise
        self._stored.pop(name, None)

    def remove(self) -> int:
        """Delete every slice of this driver on this node (uninstall); returns how many."""
        with self._lock:
            n = 0
            for obj in self.api.list_slices(self.cfg.driver_name, self.node):
                self._delete(obj["metadata"]["name"])
                n += 1
            return n
