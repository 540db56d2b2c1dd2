"""Client of the kubelet PodResources API v1 (List): which vGPU IDs are assigned."""

from __future__ import annotations

import grpc

from device_plugin.api import podresources_pb2 as pb
from device_plugin.api import podresources_pb2_grpc as pb_grpc

MAX_MESSAGE = 16 * 1024 * 1024  # kubelet's usual limit


class PodResourcesUnavailable(RuntimeError):
    pass


def assigned_ids(socket_path: str, resource_name: str, timeout: float = 10.0) -> set[str]:
    """Device IDs of `resource_name` assigned to any container, per kubelet."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE)]
    try:
        with grpc.insecure_channel(f"unix://{socket_path}", options=opts) as ch:
            resp = pb_grpc.PodResourcesListerStub(ch).List(pb.ListPodResourcesRequest(), timeout=timeout)
    except grpc.RpcError as e:
        details = e.details() if hasattr(e, "details") else str(e)
        raise PodResourcesUnavailable(f"PodResources List on {socket_path} failed: {details}") from None
    ids: set[str] = set()
    for pod in resp.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                if d.resource_name == resource_name:
                    ids.update(d.device_ids)
    return ids
