"""The kubelet device manager's checkpoint file, byte for byte as kubelet v1.36 writes it.

`<root>/device-plugins/kubelet_internal_checkpoint` (pkg/kubelet/cm/devicemanager/manager.go,
`kubeletDeviceManagerCheckpoint`), checkpoint format v2
(pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go):

    type PodDevicesEntry struct { PodUID, ContainerName, ResourceName string;
                                  DeviceIDs DevicesPerNUMA /* map[int64][]string */; AllocResp []byte }
    type checkpointData struct { PodDeviceEntries []PodDevicesEntry; RegisteredDevices map[string][]string }
    type Data struct { Data checkpointData; Checksum checksum.Checksum }

`MarshalCheckpoint` is `json.Marshal(*cp)` after `cp.Checksum = checksum.New(cp.Data)`: Go's
encoding/json (struct fields in declaration order, map keys sorted as strings, []byte as standard
base64, nil slices and maps as null, `<`, `>`, `&` escaped). The checksum
(pkg/kubelet/checkpointmanager/checksum/checksum.go) is FNV-32a over
`hashutil.DeepHashObject` = `dump.ForHash(data)` (k8s.io/utils/dump: go-spew `%#v` with
SortKeys, DisableMethods, SpewKeys, DisablePointerAddresses, DisableCapacities), stored as a
uint64. `_spew` writes that text for these types; tests check it against the three recorded
checkpoints. AllocResp is the plugin's ContainerAllocateResponse, proto-marshalled
(pod_devices.go `toCheckpointData`): the kubelet replays it when it (re)starts a container.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["CorruptCheckpoint", "Entry", "checksum", "marshal", "unmarshal"]


class CorruptCheckpoint(ValueError):
    """checkpointmanager/errors.CorruptCheckpointError: the checksum does not match."""


@dataclass
class Entry:
    """One PodDevicesEntry. `device_ids` is DevicesPerNUMA (NUMA node -> IDs; -1: no topology);
    None stands for Go's nil map/slice where the distinction shows in the file."""

    pod_uid: str
    container: str
    resource: str
    device_ids: dict[int, list[str] | None] | None
    alloc_resp: bytes | None


def _spew_strings(ids: list[str] | None) -> str:
    return "<nil>" if ids is None else "[" + " ".join(ids) + "]"


def _spew(entries: list[Entry] | None, registered: dict[str, list[str] | None] | None) -> str:
    """go-spew `%#v` of checkpointData with k8s.io/utils/dump's hash config (format.go: the top
    value and struct fields carry their type in parentheses; slice elements, map keys and values
    do not; strings unquoted; SortKeys: int keys numerically, string keys lexically)."""

    def entry(e: Entry) -> str:
        if e.device_ids is None:
            devs = "<nil>"
        else:
            devs = "map[" + " ".join(f"{k}:{_spew_strings(v)}" for k, v in sorted(e.device_ids.items())) + "]"
        resp = "<nil>" if e.alloc_resp is None else "[" + " ".join(str(b) for b in e.alloc_resp) + "]"
        return (
            f"{{PodUID:(string){e.pod_uid} ContainerName:(string){e.container} "
            f"ResourceName:(string){e.resource} DeviceIDs:(checkpoint.DevicesPerNUMA){devs} "
            f"AllocResp:([]uint8){resp}}}"
        )

    pe = "<nil>" if entries is None else "[" + " ".join(entry(e) for e in entries) + "]"
    if registered is None:
        rd = "<nil>"
    else:
        rd = "map[" + " ".join(f"{k}:{_spew_strings(v)}" for k, v in sorted(registered.items())) + "]"
    return (
        f"(checkpoint.checkpointData){{PodDeviceEntries:([]checkpoint.PodDevicesEntry){pe} "
        f"RegisteredDevices:(map[string][]string){rd}}}"
    )


def checksum(entries: list[Entry] | None, registered: dict[str, list[str] | None] | None) -> int:
    """checksum.New(checkpointData): FNV-32a (hash/fnv New32a) of the spew text."""
    h = 0x811C9DC5
    for b in _spew(entries, registered).encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def _go_json(value: Any) -> str:
    # encoding/json: compact, non-ASCII kept, HTML-significant characters escaped.
    s = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def marshal(entries: list[Entry] | None, registered: dict[str, list[str] | None] | None) -> bytes:
    """The file's bytes (Data.MarshalCheckpoint)."""

    def entry(e: Entry) -> dict[str, Any]:
        devs = (
            None
            if e.device_ids is None
            # map keys sorted as their decimal strings (encoding/json sorts the resolved key names)
            else {str(k): e.device_ids[k] for k in sorted(e.device_ids, key=str)}
        )
        return {
            "PodUID": e.pod_uid,
            "ContainerName": e.container,
            "ResourceName": e.resource,
            "DeviceIDs": devs,
            "AllocResp": None if e.alloc_resp is None else base64.b64encode(e.alloc_resp).decode(),
        }

    data = {
        "PodDeviceEntries": None if entries is None else [entry(e) for e in entries],
        "RegisteredDevices": None if registered is None else {k: registered[k] for k in sorted(registered)},
    }
    return _go_json({"Data": data, "Checksum": checksum(entries, registered)}).encode()


def unmarshal(blob: bytes) -> tuple[list[Entry] | None, dict[str, list[str] | None] | None]:
    """(entries, registered devices) of a checkpoint file; raises CorruptCheckpoint when the
    checksum does not match (Data.VerifyChecksum) and ValueError when it is not one. Fields
    Go's json.Unmarshal does not know are ignored, as there."""
    doc = json.loads(blob)
    if not isinstance(doc, dict) or not isinstance(doc.get("Data"), dict):
        raise ValueError("not a device manager checkpoint")
    raw = doc["Data"]
    entries: list[Entry] | None = None
    if raw.get("PodDeviceEntries") is not None:
        entries = []
        for r in raw["PodDeviceEntries"]:
            devs = r.get("DeviceIDs")
            entries.append(
                Entry(
                    pod_uid=str(r.get("PodUID", "")),
                    container=str(r.get("ContainerName", "")),
                    resource=str(r.get("ResourceName", "")),
                    device_ids=None if devs is None else {int(k): v for k, v in devs.items()},
                    alloc_resp=None if r.get("AllocResp") is None else base64.b64decode(r["AllocResp"]),
                )
            )
    reg = raw.get("RegisteredDevices")
    registered = None if reg is None else dict(reg)
    if int(doc.get("Checksum", -1)) != checksum(entries, registered):
        raise CorruptCheckpoint("checkpoint checksum mismatch")
    return entries, registered
