from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hook import support


class Node:
    """One test's host view: state dir, log dir, runc root, the library to mount."""

    def __init__(self, base: Path, lib: Path, shell: bool = False) -> None:
        self.shell = shell
        self.base = base
        self.state = base / "state"
        self.logs = base / "log"
        self.runc_root = base / "runc"
        self.lib = lib
        self.state.mkdir()
        self.logs.mkdir()
        self.runc_root.mkdir()
        self._n = 0

    def hooks(self) -> dict[str, object]:
        return support.hooks(self.state, self.lib, self.logs, shell=self.shell)

    def bundle(self, args: list[str], **kw: object) -> Path:
        self._n += 1
        return support.make_bundle(self.base / f"bundle{self._n}", args, hook=self.hooks(), **kw)  # type: ignore[arg-type]

    def run(self, bundle: Path, cid: str) -> object:
        return support.runc_run(self.runc_root, bundle, cid)

    def containers(self) -> list[str]:
        d = self.state / "containers"
        return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.fixture(scope="session")
def hook_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return support.placeholder_library(tmp_path_factory.mktemp("lib"))


@pytest.fixture
def node(tmp_path: Path, hook_lib: Path) -> Iterator[Node]:
    """The Python hook invoked directly (`python3 -I -S fastpath.py`)."""
    if not support.have_runc():
        pytest.skip("needs root, runc and busybox-static")
    yield Node(tmp_path, hook_lib)


@pytest.fixture(params=["python", "shell-filter"])
def any_node(request: pytest.FixtureRequest, tmp_path: Path, hook_lib: Path) -> Iterator[Node]:
    """Both installed forms of the hook: Python directly, and behind the sh filter."""
    if not support.have_runc():
        pytest.skip("needs root, runc and busybox-static")
    yield Node(tmp_path, hook_lib, shell=request.param == "shell-filter")
