"""The parts of a Pod the device plugin reads from the API server (msgspec; unknown fields are
ignored, so a Pod decodes into just these)."""

from __future__ import annotations

import msgspec


class PodMeta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    annotations: dict[str, str] | None = None
    deletionTimestamp: str | None = None


class PodStatus(msgspec.Struct):
    phase: str = ""


class Pod(msgspec.Struct):
    metadata: PodMeta = msgspec.field(default_factory=PodMeta)
    status: PodStatus = msgspec.field(default_factory=PodStatus)


class PodList(msgspec.Struct):
    items: list[Pod] | None = None


pod_decoder = msgspec.json.Decoder(Pod)
pod_list_decoder = msgspec.json.Decoder(PodList)
