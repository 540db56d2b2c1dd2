"""Registration with the kubelet (`/v1beta1.Registration/Register` on kubelet.sock)."""

from __future__ import annotations

import re
import time

import grpc

from device_plugin.api import deviceplugin_pb2 as pb
from device_plugin.api import deviceplugin_pb2_grpc as pb_grpc

API_VERSION = "v1beta1"
# A refused Register is tried again after this, growing by half up to the cap.
_RETRY_FIRST_S = 0.01
_RETRY_MAX_S = 0.1


class RegistrationError(RuntimeError):
    pass


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def valid_resource_name(name: str) -> bool:
    """An extended resource name kubelet accepts: `<dns-subdomain>/<name>`, not in
    the kubernetes.io domain, not `requests.*` (v1helper.IsExtendedResourceName)."""
    domain, sep, rest = name.partition("/")
    if not sep or name.startswith("requests."):
        return False
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return False
    return len(domain) <= 253 and bool(_DNS_SUBDOMAIN.match(domain)) and len(rest) <= 63 and bool(_NAME.match(rest))


def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float = 5.0) -> None:
    """Call Register; raises RegistrationError with kubelet's message on failure.

    kubelet.sock exists before it accepts: the kubelet's `net.Listen` binds (the file appears
    and inotify wakes us) and then listens (Go net/sock_posix.go `listenStream`), and a connect
    in between is refused - seen on the real kubelet under load, 32 ms after the file appeared.
    gRPC would then wait its reconnect backoff (1 s +-20 %) before connecting again, past the
    moment the restarted kubelet re-admits its pods (~0.8 s after; a pod with a GPU init
    container is rejected when our devices are not back by then). So an attempt fails fast (no
    wait_for_ready: an unreachable kubelet is UNAVAILABLE at once) and is made again on a new
    channel within 10-100 ms, until `timeout`."""
    req = pb.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    deadline = time.monotonic() + timeout
    pause = _RETRY_FIRST_S
    while True:
        try:
            with grpc.insecure_channel(f"unix://{kubelet_socket}") as ch:
                pb_grpc.RegistrationStub(ch).Register(req, timeout=max(0.001, deadline - time.monotonic()))
            return
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() + pause < deadline:
                time.sleep(pause)
                pause = min(pause * 1.5, _RETRY_MAX_S)
                continue
            details = e.details() if hasattr(e, "details") else str(e)
            raise RegistrationError(f"{code.name if code else 'error'}: {details}") from None
