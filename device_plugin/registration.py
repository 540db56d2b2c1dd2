"""Registration with the kubelet (`/v1beta1.Registration/Register` on kubelet.sock)."""

from __future__ import annotations

import grpc

from device_plugin.api import deviceplugin_pb2 as pb
from device_plugin.api import deviceplugin_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"


class RegistrationError(RuntimeError):
    pass


def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float = 5.0) -> None:
    """Call Register; raises RegistrationError with kubelet's message on failure."""
    req = pb.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    try:
        with grpc.insecure_channel(f"unix://{kubelet_socket}") as ch:
            pb_grpc.RegistrationStub(ch).Register(req, timeout=timeout, wait_for_ready=True)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        raise RegistrationError(f"{code.name if code else 'error'}: {details}") from None
