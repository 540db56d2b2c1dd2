"""What the kubelet may still replay: the Allocate answers kept in its device manager checkpoint.

The kubelet calls Allocate once per container and keeps the answer
(`<kubelet_dir>/device-plugins/kubelet_internal_checkpoint`, one entry per pod UID, container
and resource, the response proto-marshalled in `AllocResp`; kubelet
pkg/kubelet/cm/devicemanager/checkpoint/checkpoint.go, pod_devices.go `toCheckpointData`). It
never asks again for a container it has an entry for: when a container restarts, when the pod's
sandbox is recreated (init containers run again) and after a kubelet restart it replays the
kept answer (manager.go `GetDeviceRunContainerOptions` -> `deviceRunContainerOptions`), so the
container gets the same token. An entry lives as long as its pod is active in the kubelet; it is
dropped when the pod is gone (`UpdateAllocatedDevices`) and the file rewritten at the kubelet's
next checkpoint write (after an allocation, on a device list update).

So a record is still needed exactly while its token is in this file. Nothing else tells: an init
container's vGPUs are given to the app container (two records name the same vGPU IDs, both
replayed), PodResources does not list init containers at all, and an init container may hold
vGPUs its pod's app containers do not.

Each entry also names the pod (the kubelet's UID of it) and the container holding the answer.
The usage the plugin publishes carries them (device_plugin/usage.py): the scheduler stops counting
a slice when its pod ends, although the record stays until the kubelet rewrites this file.

The file is the kubelet's (root-only directory, written by rename); it is still parsed as
untrusted input: bounded size, every field checked. Anything unexpected makes the whole file
unusable (CheckpointUnusable), and the caller then keeps every record: a record deleted too early
fails a container, one kept too long costs a few hundred bytes.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError

from device_plugin.api import deviceplugin_pb2 as pb
from vgpu.schemas import TOKEN_ANNOTATION, TOKEN_ENV

CHECKPOINT = "kubelet_internal_checkpoint"
# A node's checkpoint is a few hundred bytes per container; this bound only stops a runaway read.
MAX_BYTES = 64 << 20
# A pod UID is 36 characters and a container name at most 63 (DNS label); longer text is cut, so a
# bad file cannot make the published usage annotation grow.
MAX_NAME = 253


class CheckpointUnusable(RuntimeError):
    pass


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointUnusable(f"{path} does not exist (no kubelet has written it yet)") from None
    except OSError as e:
        raise CheckpointUnusable(f"cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_BYTES:
        raise CheckpointUnusable(f"{path} is larger than {MAX_BYTES} bytes")
    return data


def _entries(doc: Any) -> list[Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("Data"), dict):
        raise CheckpointUnusable("not a kubelet device manager checkpoint (no Data object)")
    entries = doc["Data"].get("PodDeviceEntries")
    if entries is None:  # Go's nil slice: no container holds a device
        return []
    if not isinstance(entries, list):
        raise CheckpointUnusable("PodDeviceEntries is not a list")
    return entries


class Kept(NamedTuple):
    """One kept answer of our resource: the pod (the kubelet's UID) and container it was given to,
    and the allocation tokens it carries."""

    pod_uid: str
    container: str
    tokens: frozenset[str]


def kept_answers(path: str, resource_name: str) -> list[Kept]:
    """The kubelet's kept Allocate answers for `resource_name`, with the pod UID and container name
    of each entry (PodDevicesEntry.PodUID, ContainerName)."""
    try:
        doc = json.loads(_read(path))
    except ValueError as e:
        raise CheckpointUnusable(f"{path} is not JSON: {e}") from None
    out: list[Kept] = []
    for i, ent in enumerate(_entries(doc)):
        if not isinstance(ent, dict) or not isinstance(ent.get("ResourceName"), str):
            raise CheckpointUnusable(f"entry {i} has no ResourceName")
        if ent["ResourceName"] != resource_name:
            continue
        raw = ent.get("AllocResp")
        if raw is None:  # the kubelet skips such entries when it writes; nothing to replay
            continue
        if not isinstance(raw, str):
            raise CheckpointUnusable(f"entry {i}: AllocResp is not a string")
        try:
            resp = pb.ContainerAllocateResponse.FromString(base64.b64decode(raw, validate=True))
        except (binascii.Error, ValueError, DecodeError) as err:
            raise CheckpointUnusable(f"entry {i}: AllocResp is not an Allocate answer: {err}") from None
        pod, container = ent.get("PodUID"), ent.get("ContainerName")
        if not isinstance(pod, str) or not isinstance(container, str):
            raise CheckpointUnusable(f"entry {i}: PodUID or ContainerName is not a string")
        # Both carriers, should they ever differ: either is what the hook may be given.
        tokens = frozenset(t for t in (resp.envs.get(TOKEN_ENV), resp.annotations.get(TOKEN_ANNOTATION)) if t)
        out.append(Kept(pod[:MAX_NAME], container[:MAX_NAME], tokens))
    return out


def replayable_tokens(path: str, resource_name: str) -> set[str]:
    """The allocation tokens in the kubelet's kept Allocate answers for `resource_name`."""
    return {t for k in kept_answers(path, resource_name) for t in k.tokens}


def holders(path: str, resource_name: str) -> dict[str, tuple[str, str]]:
    """token -> (pod UID, container) of the kept answer carrying it: who holds each record's slice.
    A token in two entries (never written so by us: one token per Allocate answer) keeps the first."""
    out: dict[str, tuple[str, str]] = {}
    for k in kept_answers(path, resource_name):
        for t in k.tokens:
            out.setdefault(t, (k.pod_uid, k.container))
    return out


def default_path(kubelet_dir: str) -> str:
    return os.path.join(kubelet_dir, "device-plugins", CHECKPOINT)
