"""The image of `make image`, built once per test session (cached by content hash: an unchanged
tree rebuilds nothing), and its root file system unpacked from the OCI archive's layers."""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "build" / "image"


def build(out: Path = OUT) -> dict[str, Any]:
    """Run packaging/image/build.py (what `make image` runs) and return its name=value lines."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "packaging/image/build.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"packaging/image/build.py failed:\n{r.stderr[-4000:]}")
    info: dict[str, Any] = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    return info


def read_archive(oci: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], tarfile.TarFile]:
    """(index, manifest, config, open tar) of an OCI archive."""
    tar = tarfile.open(oci)

    def blob(digest: str) -> bytes:
        f = tar.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
        assert f is not None
        return f.read()

    index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    return index, manifest, config, tar


def rootfs(info: dict[str, Any]) -> Path:
    """The image's layers unpacked in order (cached per manifest digest)."""
    d = OUT / f"rootfs-{info['digest'].split(':')[1][:16]}"
    with open(OUT / ".rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (d / ".complete").exists():
            return d
        for old in OUT.glob("rootfs-*"):
            shutil.rmtree(old, ignore_errors=True)
        d.mkdir(parents=True)
        _index, manifest, _config, tar = read_archive(Path(info["oci_archive"]))
        with tar:
            for layer in manifest["layers"]:
                f = tar.extractfile(f"blobs/sha256/{layer['digest'].split(':', 1)[1]}")
                assert f is not None
                with tarfile.open(fileobj=f, mode="r|gz") as lt:
                    lt.extractall(d, filter="fully_trusted", numeric_owner=True)
        (d / ".complete").touch()
        return d


def image_files(info: dict[str, Any]) -> dict[str, tarfile.TarInfo]:
    """Every entry of every layer (later layers win), by path."""
    _index, manifest, _config, tar = read_archive(Path(info["oci_archive"]))
    out: dict[str, tarfile.TarInfo] = {}
    with tar:
        for layer in manifest["layers"]:
            f = tar.extractfile(f"blobs/sha256/{layer['digest'].split(':', 1)[1]}")
            assert f is not None
            with tarfile.open(fileobj=f, mode="r|gz") as lt:
                for m in lt:
                    out[m.name] = m
    return out


def default_config(root: Path) -> str:
    """`containerd config default` of the root's own containerd (the config most nodes have)."""
    return subprocess.run(
        ["chroot", str(root), "containerd", "config", "default"], capture_output=True, text=True, check=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    ).stdout  # fmt: skip
