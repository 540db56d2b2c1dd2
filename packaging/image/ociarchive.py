"""Deterministic image layers and archives: OCI archive (`ctr images import`, `podman load`) and
docker-archive (`docker load`), written with the standard library only.

Layers are tar files with sorted entries, uid/gid as stored, no user/group names, mtimes clamped
to SOURCE_DATE_EPOCH, gzip with mtime 0 and no file name: the same inputs give the same bytes,
so the same digests.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZ = "application/vnd.oci.image.layer.v1.tar+gzip"


@dataclass(frozen=True)
class Layer:
    path: Path  # the gzipped layer file
    digest: str  # sha256:... of the gzipped bytes
    diff_id: str  # sha256:... of the uncompressed tar
    size: int
    tar_size: int = 0  # uncompressed


def _norm(info: tarfile.TarInfo, epoch: int) -> tarfile.TarInfo:
    info.mtime = min(int(info.mtime), epoch)
    info.uname = info.gname = ""
    info.pax_headers = {}
    return info


def write_layer(
    out: Path, entries: Iterable[tuple[tarfile.TarInfo, Callable[[], io.BufferedIOBase] | None]], epoch: int
) -> Layer:
    """Write a gzipped layer from (TarInfo, opener) pairs (sorted here by name)."""
    diff = hashlib.sha256()
    counted = [0]
    comp = hashlib.sha256()

    class _Tee(io.RawIOBase):
        def __init__(self, f: io.BufferedWriter) -> None:
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            comp.update(b)
            return self.f.write(b)

    class _Diff(io.RawIOBase):
        def __init__(self, g: gzip.GzipFile) -> None:
            self.g = g

        def writable(self) -> bool:
            return True

        def write(self, b: bytes) -> int:  # type: ignore[override]
            diff.update(b)
            counted[0] += len(b)
            return self.g.write(b)

    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as raw:
        tee = _Tee(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=tee, mtime=0, compresslevel=6) as gz:  # type: ignore[arg-type]
            dw = _Diff(gz)
            with tarfile.open(fileobj=dw, mode="w|", format=tarfile.GNU_FORMAT) as tar:  # type: ignore[arg-type]
                for info, opener in sorted(entries, key=lambda e: e[0].name):
                    info = _norm(info, epoch)
                    if info.isreg() and opener is not None:
                        with opener() as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
    os.replace(tmp, out)
    return Layer(out, "sha256:" + comp.hexdigest(), "sha256:" + diff.hexdigest(), out.stat().st_size, counted[0])


def tree_entries(root: Path, dest: str = "/") -> list[tuple[tarfile.TarInfo, Callable[[], io.BufferedIOBase] | None]]:
    """Entries of a directory tree placed at `dest` in the image (owner root)."""
    out: list[tuple[tarfile.TarInfo, Callable[[], io.BufferedIOBase] | None]] = []
    base = dest.strip("/")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*dirnames, *sorted(filenames)]:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            arc = f"{base}/{rel}" if base else rel
            st = full.lstat()
            info = tarfile.TarInfo(arc)
            info.mode = st.st_mode & 0o7777
            info.uid = info.gid = 0
            info.mtime = int(st.st_mtime)
            if full.is_symlink():
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(full)
                out.append((info, None))
            elif full.is_dir():
                info.type = tarfile.DIRTYPE
                out.append((info, None))
            else:
                info.size = st.st_size
                out.append((info, lambda p=full: open(p, "rb")))  # type: ignore[misc]
    return out


def parent_dirs(paths: Iterable[str], epoch: int) -> list[tuple[tarfile.TarInfo, None]]:
    seen: set[str] = set()
    out: list[tuple[tarfile.TarInfo, None]] = []
    for p in paths:
        parts = p.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in seen:
                seen.add(d)
                info = tarfile.TarInfo(d)
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                info.mtime = epoch
                out.append((info, None))
    return out


def _arch() -> str:
    m = os.uname().machine
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def image_config(layers: list[Layer], cfg: dict[str, object], epoch: int, history: list[str]) -> bytes:
    created = _rfc3339(epoch)
    doc = {
        "architecture": _arch(),
        "os": "linux",
        "created": created,
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": h} for h in history],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _rfc3339(epoch: int) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, src: Path | None = None, epoch: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = epoch
    info.mode = 0o644
    if src is not None:
        info.size = src.stat().st_size
        with open(src, "rb") as f:
            tar.addfile(info, f)
    else:
        assert data is not None
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def _dir(tar: tarfile.TarFile, name: str, epoch: int) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    info.mtime = epoch
    tar.addfile(info)


def oci_manifest(layers: list[Layer], config: bytes, annotations: dict[str, str]) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": _sha(config), "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER_GZ, "digest": la.digest, "size": la.size} for la in layers],
        "annotations": annotations,
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_oci_archive(out: Path, ref: str, layers: list[Layer], config: bytes, manifest: bytes, epoch: int) -> str:
    """OCI image layout in a tar; the index names the image `ref` (containerd, podman). Returns the manifest digest."""
    mdigest = _sha(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": mdigest,
                "size": len(manifest),
                "platform": {"architecture": _arch(), "os": "linux"},
                # containerd (ctr images import) reads the first, podman/skopeo the second (full name).
                "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref},
            }
        ],
    }
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), epoch=epoch)
        _add(tar, "index.json", json.dumps(index, sort_keys=True).encode(), epoch=epoch)
        _dir(tar, "blobs", epoch)
        _dir(tar, "blobs/sha256", epoch)
        for la in layers:
            _add(tar, f"blobs/sha256/{la.digest[7:]}", src=la.path, epoch=epoch)
        _add(tar, f"blobs/sha256/{_sha(config)[7:]}", config, epoch=epoch)
        _add(tar, f"blobs/sha256/{mdigest[7:]}", manifest, epoch=epoch)
    os.replace(tmp, out)
    return mdigest


def write_docker_archive(out: Path, ref: str, layers: list[Layer], config: bytes, epoch: int) -> None:
    """`docker save` format: manifest.json + config + one gzipped layer.tar per layer (docker load decompresses)."""
    cfg_name = _sha(config)[7:] + ".json"
    man = [{"Config": cfg_name, "RepoTags": [ref], "Layers": [f"{la.digest[7:]}/layer.tar" for la in layers]}]
    repo, tag = ref.rsplit(":", 1)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, cfg_name, config, epoch=epoch)
        for la in layers:
            _dir(tar, la.digest[7:], epoch)
            _add(tar, f"{la.digest[7:]}/layer.tar", src=la.path, epoch=epoch)
        _add(tar, "manifest.json", json.dumps(man).encode(), epoch=epoch)
        top = layers[-1].digest[7:]
        _add(tar, "repositories", json.dumps({repo: {tag: top}}).encode(), epoch=epoch)
    os.replace(tmp, out)
