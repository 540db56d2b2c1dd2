"""In-root path resolution: openat2(RESOLVE_IN_ROOT) and the userspace walk agree, and neither leaves the root."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime_hook import mounts, rootfs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    old = rootfs.force_walk
    rootfs.force_walk = request.param == "walk"
    try:
        yield request.param
    finally:
        rootfs.force_walk = old


def _rootfd(p: Path) -> int:
    return os.open(p, os.O_PATH | os.O_DIRECTORY)


def _ino(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    os.close(fd)
    return st.st_dev, st.st_ino


def test_absolute_and_dotdot_links_stay_inside(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    host = tmp_path / "host"
    (root / "inside").mkdir(parents=True)
    host.mkdir()
    (host / "secret").write_text("host")
    (root / "inside" / "secret").write_text("root")
    (root / "abs").symlink_to("/inside")
    (root / "up").symlink_to("../../../../../inside")
    (root / "hostlink").symlink_to(str(host / "secret"))
    fd = _rootfd(root)
    try:
        for p in ("abs/secret", "up/secret", "../../inside/secret", "/inside/secret"):
            assert _ino(rootfs.open_in_root(fd, p, os.O_PATH)) == _ino(os.open(root / "inside" / "secret", os.O_PATH))
        with pytest.raises(FileNotFoundError):  # the absolute host path does not exist *inside* the root
            rootfs.open_in_root(fd, "hostlink", os.O_RDONLY)
        assert rootfs.read_file(fd, "abs/secret") == b"root"
        assert rootfs.read_file(fd, "missing/file") is None
    finally:
        os.close(fd)


def test_ensure_dir_and_mountpoint_create_inside_only(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "var" / "run").mkdir(parents=True)
    (root / "run").symlink_to("/var/run")
    fd = _rootfd(root)
    try:
        t = rootfs.file_mountpoint(fd, "/run/vgpu/limits")
        os.close(t)
        assert (root / "var" / "run" / "vgpu" / "limits").is_file()
        assert not os.path.lexists("/var/run/vgpu")
        os.symlink("/etc/hostname", root / "var" / "run" / "vgpu" / "region")
        with pytest.raises(rootfs.HostileRootfs, match="is a symlink"):
            rootfs.file_mountpoint(fd, "run/vgpu/region")
        os.mkfifo(root / "var" / "run" / "vgpu" / "fifo")
        with pytest.raises(rootfs.HostileRootfs, match="FIFO"):
            rootfs.read_file(fd, "run/vgpu/fifo")  # must not block
    finally:
        os.close(fd)


def test_symlink_loop_is_refused(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").symlink_to("b")
    (root / "b").symlink_to("a")
    fd = _rootfd(root)
    try:
        with pytest.raises(OSError) as ei:
            rootfs.open_in_root(fd, "a/x", os.O_PATH)
        assert ei.value.errno == errno.ELOOP
        with pytest.raises(rootfs.HostileRootfs):
            rootfs.ensure_dir(fd, "a/x")
    finally:
        os.close(fd)


# ---- property: the walk resolves exactly like the kernel ---------------------------------

NAMES = ["a", "b", "c"]
_target = st.lists(st.sampled_from([*NAMES, "..", ".", ""]), min_size=0, max_size=4).map("/".join)
_entry = st.tuples(
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join),
    st.one_of(
        st.just(("dir", "")),
        st.just(("file", "")),
        _target.map(lambda t: ("link", t)),
        _target.map(lambda t: ("link", "/" + t)),
    ),
)


def _resolve(fd: int, path: str, walk: bool) -> object:
    old = rootfs.force_walk
    rootfs.force_walk = walk
    try:
        return ("ok", _ino(rootfs.open_in_root(fd, path, os.O_PATH)))
    except OSError as e:
        return ("err", e.errno)
    finally:
        rootfs.force_walk = old


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(_entry, max_size=8), paths=st.lists(_target, min_size=1, max_size=4))
def test_walk_matches_openat2(tmp_path_factory: pytest.TempPathFactory, entries: list, paths: list[str]) -> None:
    root = tmp_path_factory.mktemp("prop")
    for rel, (kind, target) in entries:
        p = root / rel
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if kind == "dir":
                p.mkdir()
            elif kind == "file":
                p.write_text("x")
            else:
                p.symlink_to(target or ".")
        except OSError:
            continue
    fd = _rootfd(root)
    try:
        for path in paths:
            a = _resolve(fd, path, walk=False)
            b = _resolve(fd, path, walk=True)
            assert a == b, (path, entries)
    finally:
        os.close(fd)


def test_merge_preload() -> None:
    lib = "/run/vgpu/libvgpu.so"
    text, dropped = mounts.merge_preload(lib, b"# c\n/a.so:/b.so /a.so\n\n/run/vgpu/libvgpu.so\n/\xffbad.so\n")
    assert text == f"{lib}\n/a.so\n/b.so\n"
    assert dropped == ["/\xffbad.so"]
    assert mounts.merge_preload(lib, None) == (lib + "\n", [])
