"""Build a minimal OCI image archive (oci-layout tar) from a rootfs directory.

Used by the containerd test: `ctr images import` takes it like any image
pulled from a registry, so containerd's CRI path runs exactly as under kubelet.

An image that stands for a CUDA workload carries the env of NVIDIA's nvidia/cuda images
(`CUDA_ENV`, the default): `NVIDIA_VISIBLE_DEVICES=all` among it, which containerd's CRI keeps
ahead of the device plugin's value in config.json (recorded with a real kubelet and containerd
1.6: tests/data/real-traces/containerd-cri/kubelet-pod-cuda-env-image.config.json).  A sandbox
(pause) image has only a PATH (`PAUSE_ENV`): the sandbox gets the image's env too, and on a
handler that runs NVIDIA's runtime `all` there would mean every GPU.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path


def _layer(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = Path(dirpath) / name
                arc = str(full.relative_to(rootfs))
                info = tar.gettarinfo(str(full), arcname=arc)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                if info.isfile():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


# The Env of nvidia/cuda:12.4.x images (their Dockerfiles set these; NVIDIA_REQUIRE_CUDA is
# longer there, the driver-branch clauses do not matter here), as in the recorded image.
CUDA_ENV = [
    "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "NVIDIA_VISIBLE_DEVICES=all",
    "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
    "NVIDIA_REQUIRE_CUDA=cuda>=12.4",
    "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
]
PAUSE_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]


def build_image(rootfs: Path, out: Path, name: str, cmd: list[str], env: list[str] | None = None) -> Path:
    """Write `out` (an OCI archive) holding one image `name` with rootfs as its single layer.
    `env`: the image config's Env, nvidia/cuda's (`CUDA_ENV`) unless given (`PAUSE_ENV` for a
    sandbox image)."""
    layer = _layer(rootfs)
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    with tarfile.open(out, "w") as tar:
        layer_digest = _blob(tar, layer)
        config = {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": list(CUDA_ENV if env is None else env), "Cmd": cmd, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        cfg_bytes = json.dumps(config).encode()
        cfg_digest = _blob(tar, cfg_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": cfg_digest,
                "size": len(cfg_bytes),
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}
            ],
        }
        man_bytes = json.dumps(manifest).encode()
        man_digest = _blob(tar, man_bytes)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": man_digest,
                    "size": len(man_bytes),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
        for fname, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index).encode()),
        ):
            info = tarfile.TarInfo(fname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out
