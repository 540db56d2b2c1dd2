"""Fixtures of the acceptance suite (tests/cluster): a real cluster named by KUBECONFIG.

`make test-cluster` runs it; `make test` never collects it (tests/conftest.py: only a path
under tests/cluster given on the command line does), and without KUBECONFIG every test skips.
Each run works in a namespace of its own (`$VGPU_TEST_NAMESPACE_PREFIX-<random>`), deleted at
the end with every PriorityClass it made; each test deletes its pods and waits until they are
gone, so the next test finds the GPUs free.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.kube import Cluster, Obj, Settings, pod_body


@pytest.fixture(scope="session")
def settings() -> Settings:
    s = Settings.from_env()
    if s is None:
        pytest.skip("no cluster: set KUBECONFIG (make test-cluster KUBECONFIG=...)")
    return s


@pytest.fixture(scope="session")
def cluster(settings: Settings) -> Iterator[Cluster]:
    c = Cluster(settings)
    c.create_namespace()
    try:
        yield c
    finally:
        try:
            c.delete_priority_classes()
        finally:
            c.delete_namespace(timeout=max(settings.timeout_s, 120.0))


class Pods:
    """The pods one test creates; deleted (and waited for) when the test ends."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.names: list[str] = []

    def create(self, name: str, limits: dict[str, str], **kw: object) -> Obj:
        body = pod_body(self.cluster.settings, name, limits, **kw)  # type: ignore[arg-type]
        self.names.append(name)
        return self.cluster.create_pod(body)

    def create_body(self, body: Obj) -> Obj:
        self.names.append(body["metadata"]["name"])
        return self.cluster.create_pod(body)

    def cleanup(self) -> None:
        for n in self.names:
            self.cluster.delete_pod(n)
        self.cluster.wait_gone(self.names)
        self.names = []


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Pods]:
    p = Pods(cluster)
    try:
        yield p
    finally:
        p.cleanup()
