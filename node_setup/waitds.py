"""`vgpu-node-setup wait-daemonset`: the uninstall hook Job's wait for the per-node uninstall pods.

Ready means every scheduled pod of the DaemonSet is ready, i.e. its `vgpu-node-setup uninstall`
init container exited 0 on that node.  Uses the pod's service account (in-cluster config).
"""

from __future__ import annotations

import time
from typing import Any


def done(status: Any) -> bool:
    desired = status.desired_number_scheduled or 0
    return (status.number_ready or 0) >= desired and (status.updated_number_scheduled or 0) >= desired


def wait(namespace: str, name: str, timeout: float, interval: float = 2.0, api: Any = None) -> bool:
    if api is None:
        from kubernetes import client

        from vgpu import kube

        api_client = kube.load()
        if api_client is None:
            raise kube.KubeConfigError("no in-cluster service account and no kubeconfig")
        api = client.AppsV1Api(api_client)
    deadline = time.monotonic() + timeout
    while True:
        ds = api.read_namespaced_daemon_set(name, namespace)
        if ds.status is not None and done(ds.status):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
