"""How every part of ours finds the Kubernetes API: one rule, one loader.

The rule, first match wins (kubectl's order, with the in-cluster service account where kubectl
has none):

1. an explicit kubeconfig (a daemon's `--kubeconfig`, `vgpuctl cluster --kubeconfig`);
2. `$KUBECONFIG`: its first entry that is an existing file;
3. the in-cluster service account (`KUBERNETES_SERVICE_HOST` set): daemons in pods;
4. `~/.kube/config`, if it exists.

Nothing found is not an error (`None`: a node without an API server, a test); a configuration
that exists but cannot be loaded is (`KubeConfigError`, with the client's reason). The client is
configured into a `Configuration` of its own, never the process-wide default, so two loads with
different files do not step on each other. The kubernetes package is imported only here, and only
when a configuration exists (its import costs ~0.5 s).
"""

from __future__ import annotations

import os
from typing import Any


class KubeConfigError(RuntimeError):
    """A kubeconfig or service account exists but cannot be used."""


def source(kubeconfig: str = "") -> str | None:
    """Where the configuration comes from: a kubeconfig path, "in-cluster", or None."""
    if kubeconfig:
        return kubeconfig
    for p in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if p and os.path.isfile(p):
            return p
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "in-cluster"
    home = os.path.expanduser("~/.kube/config")
    return home if os.path.isfile(home) else None


def load(kubeconfig: str = "", context: str | None = None) -> Any | None:
    """A `kubernetes.client.ApiClient` by the rule above, or None when nothing is configured."""
    where = source(kubeconfig)
    if where is None:
        return None
    if where != "in-cluster" and not os.path.isfile(where):
        raise KubeConfigError(f"no kubeconfig at {where}")
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if where == "in-cluster":
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(config_file=where, context=context, client_configuration=cfg)
    except Exception as e:  # ConfigException, unreadable or invalid files
        raise KubeConfigError(f"kubernetes client configuration ({where}): {e}") from None
    return client.ApiClient(cfg)
