#!/usr/bin/env python3
"""`make image`: the k8s-vgpu container image without a Docker daemon.

    packaging/image/build.py [--repo REPO] [--out build/image]

1. base: a Debian root from Debian packages (mmdebstrap --variant=essential + python3; no apt,
   docs, man pages, locales, caches), turned into one deterministic layer;
2. venv: packaging/build-venv.sh run INSIDE a Debian root of the same suite (+ python3-venv,
   binutils), so the venv's interpreter and wheels match the image's Python whatever the build
   host runs;
3. app layer: the venv at /opt/vgpu plus the final stage's COPY lines of packaging/image/Dockerfile;
4. the OCI archive and the docker-archive, tagged REPO:VERSION.

Each step is cached by a hash of its inputs under $VGPU_IMAGE_CACHE (default /var/cache/k8s-vgpu,
outside the checkout, so a fresh clone on the same machine reuses it); an unchanged tree rebuilds
nothing.  Prints name=value lines (image, digest, sizes, paths).  Needs root (mmdebstrap, chroot).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ociarchive

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DOCKERFILE = HERE / "Dockerfile"
DEFAULT_REPO = "ghcr.io/k8s-vgpu/k8s-vgpu"
SUITE = os.environ.get("VGPU_IMAGE_SUITE", "bookworm")
MIRROR = os.environ.get("VGPU_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "libstdc++6")  # grpcio's extension links libstdc++
BUILDER_PACKAGES = ("python3-venv", "binutils")
VENV_SOURCES = ("pyproject.toml", "README.md", "packaging/build-venv.sh", "packaging/requirements.lock")
# The project's packages that go into the venv: the ones packaging/build-venv.sh copies (its
# `for pkg in ...` line is the one list; the deb/rpm build uses it too).
VENV_PACKAGES = tuple(
    re.search(r"^for pkg in ([a-z_ ]+); do$", (HERE.parent / "build-venv.sh").read_text(), re.M).group(1).split()  # type: ignore[union-attr]
)
# Left out of the base root: docs (but not the copyright files), man pages, locales, caches.
DPKG_EXCLUDES = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/bash-completion/*",
)
_DROP = re.compile(
    r"^(dev/.+|proc/.+|sys/.+|run/.+|tmp/.+|var/tmp/.+|var/cache/.+|var/lib/apt/lists/.+|var/log/.+"
    r"|etc/hostname|etc/resolv\.conf|etc/machine-id|var/lib/dbus/machine-id|etc/apt/apt\.conf\.d/99mmdebstrap)$"
)


def log(msg: str) -> None:
    print(f"build-image: {msg}", file=sys.stderr, flush=True)


def sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(str(len(b)).encode() + b":" + b)
    return h.hexdigest()


def tree_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for base in paths:
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + oct(f.stat().st_mode & 0o111).encode())
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def version() -> str:
    m = re.search(r'__version__ = "([^"]+)"', (ROOT / "vgpu/__init__.py").read_text())
    assert m
    return m.group(1)


# ---- the Dockerfile's final stage -------------------------------------------------


class Stage:
    def __init__(self) -> None:
        self.copies: list[tuple[str, str]] = []  # (source relative to the repo, destination)
        self.from_copies: list[tuple[str, str, str]] = []  # (stage, source, destination)
        self.env: list[str] = []
        self.labels: dict[str, str] = {}
        self.cmd: list[str] = []


def final_stage(text: str = "") -> Stage:
    text = text or DOCKERFILE.read_text()
    lines: list[str] = []
    cur = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#"):
            continue
        cur += raw.rstrip("\\").strip() + " " if raw.endswith("\\") else raw.strip()
        if not raw.endswith("\\"):
            if cur.strip():
                lines.append(cur.strip())
            cur = ""
    froms = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    st = Stage()
    for ln in lines[froms[-1] + 1 :]:
        word, _, rest = ln.partition(" ")
        word = word.upper()
        if word == "COPY":
            args = shlex.split(rest)
            if args[0].startswith("--from="):
                st.from_copies.append((args[0][7:], args[1], args[2]))
            else:
                *srcs, dest = args
                st.copies.extend((s, dest) for s in srcs)
        elif word == "ENV":
            st.env.append(rest.strip())
        elif word == "LABEL":
            k, _, v = rest.strip().partition("=")
            st.labels[k] = v
        elif word == "CMD":
            st.cmd = json.loads(rest)
    return st


# ---- cached steps -------------------------------------------------------------------


def _locked(cache: Path, name: str) -> int:
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def mmdebstrap(out: str, packages: tuple[str, ...], fmt: str) -> None:
    cmd = [
        "mmdebstrap",
        "--quiet",
        "--mode=root",
        "--variant=essential",
        f"--format={fmt}",
        "--include=" + ",".join(packages),
        # Merged /usr set up by mmdebstrap itself: no usrmerge package (which drags in perl).
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *(f"--dpkgopt={o}" for o in DPKG_EXCLUDES),
        SUITE,
        out,
        MIRROR,
    ]
    for attempt in (1, 2):  # one retry: a mirror hiccup must not fail the build
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            return
        if attempt == 2:
            raise SystemExit(f"build-image: {' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def base_layer(cache: Path, epoch: int) -> tuple[ociarchive.Layer, str]:
    key = sha("base-v1", SUITE, MIRROR, *BASE_PACKAGES, *DPKG_EXCLUDES, _DROP.pattern, str(epoch))[:20]
    d = cache / f"base-{key}"
    fd = _locked(cache, "base")
    try:
        meta = d / "layer.json"
        if meta.exists():
            m = json.loads(meta.read_text())
            return ociarchive.Layer(d / "layer.tar.gz", m["digest"], m["diff_id"], m["size"], m["tar_size"]), key
        log(f"base: mmdebstrap {SUITE} + {', '.join(BASE_PACKAGES)} (cached as {d.name})")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        raw = d / "rootfs.tar"
        mmdebstrap(str(raw), BASE_PACKAGES, "tar")
        with tarfile.open(raw) as tar:
            members = []
            for m in tar.getmembers():
                m.name = m.name.removeprefix("./").rstrip("/")
                if not m.name or _DROP.match(m.name):
                    continue
                if m.islnk():
                    m.linkname = m.linkname.removeprefix("./")
                if m.ischr() or m.isblk() or m.isfifo():
                    continue
                members.append((m, (lambda mm=m: tar.extractfile(mm)) if m.isreg() else None))
            layer = ociarchive.write_layer(d / "layer.tar.gz", members, epoch)  # type: ignore[arg-type]
        raw.unlink()
        fields = {"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size, "tar_size": layer.tar_size}
        meta.write_text(json.dumps(fields))
        return layer, key
    finally:
        os.close(fd)


def builder_root(cache: Path) -> Path:
    key = sha("builder-v1", SUITE, MIRROR, *BASE_PACKAGES, *BUILDER_PACKAGES, *DPKG_EXCLUDES)[:20]
    d = cache / f"builder-{key}"
    fd = _locked(cache, "builder")
    try:
        if (d / ".complete").exists():
            return d
        log(f"builder: mmdebstrap {SUITE} + {', '.join(BUILDER_PACKAGES)} (cached as {d.name})")
        shutil.rmtree(d, ignore_errors=True)
        mmdebstrap(str(d), BASE_PACKAGES + BUILDER_PACKAGES, "directory")
        (d / ".complete").touch()
        return d
    finally:
        os.close(fd)


def venv(cache: Path, builder: Path) -> tuple[Path, str]:
    inputs = [ROOT / p for p in VENV_SOURCES] + [ROOT / p for p in VENV_PACKAGES]
    key = sha("venv-v1", builder.name, tree_hash(inputs))[:20]
    d = cache / f"venv-{key}"
    fd = _locked(cache, "venv")
    try:
        if (d / ".complete").exists():
            return d / "opt" / "vgpu", key
        log(f"venv: packaging/build-venv.sh in the {SUITE} builder root (cached as {d.name})")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        src = Path(tempfile.mkdtemp(prefix="vgpu-venv-src-", dir=cache))
        try:
            for p in VENV_SOURCES:
                (src / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / p, src / p)
            for p in VENV_PACKAGES:
                shutil.copytree(ROOT / p, src / p, ignore=shutil.ignore_patterns("__pycache__"))
            pipcache = cache / "pip"
            pipcache.mkdir(exist_ok=True)
            for sub in ("src", "out", "pipcache", "proc", "dev"):
                (builder / "mnt" / sub).mkdir(parents=True, exist_ok=True)
            shutil.copy("/etc/resolv.conf", builder / "etc" / "resolv.conf")
            mnt = builder / "mnt"
            # pip inside the root trusts what the host's pip trusts (a TLS-intercepting proxy's CA)
            # and uses the same index/proxy settings.
            ca = next((c for c in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                                   "/etc/ssl/certs/ca-certificates.crt") if c and os.path.isfile(c)), None)  # fmt: skip
            fwd = {k: v for k, v in os.environ.items()
                   if k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_DEFAULT_TIMEOUT", "http_proxy",
                            "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY")}  # fmt: skip
            binds = ""
            if ca:
                (mnt / "ca.crt").touch()
                binds = f"mount --bind {shlex.quote(ca)} {mnt}/ca.crt; "
                fwd["PIP_CERT"] = "/mnt/ca.crt"
            envs = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(fwd.items()))
            script = (
                binds + f"set -e; mount --bind {shlex.quote(str(src))} {mnt}/src; "
                f"mount --bind {shlex.quote(str(d))} {mnt}/out; "
                f"mount --bind {shlex.quote(str(pipcache))} {mnt}/pipcache; mount -t proc proc {builder}/proc; "
                f"mount --rbind /dev {builder}/dev; "
                f"exec chroot {builder} env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "
                f"PIP_CACHE_DIR=/mnt/pipcache {envs} /mnt/src/packaging/build-venv.sh /mnt/out"
            )
            r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode != 0:
                raise SystemExit(f"build-image: build-venv.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        finally:
            shutil.rmtree(src, ignore_errors=True)
        # The venv was made at /mnt/out/opt/vgpu: build-venv.sh points it at /opt/vgpu itself.
        (d / ".complete").touch()
        # Keep the three newest venvs (other checkouts on this machine may use older ones).
        venvs = sorted(cache.glob("venv-*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in venvs[3:]:
            shutil.rmtree(old, ignore_errors=True)
        return d / "opt" / "vgpu", key
    finally:
        os.close(fd)


def app_entries(venv_dir: Path, stage: Stage, staging: Path) -> list[tuple[tarfile.TarInfo, object]]:
    entries: list[tuple[tarfile.TarInfo, object]] = []
    [(_, _vsrc, vdest)] = stage.from_copies
    entries += ociarchive.tree_entries(venv_dir, vdest)
    dests = [vdest.strip("/") + "/"]
    for src, dest in stage.copies:
        s = ROOT / src
        if not s.is_file():
            raise SystemExit(f"build-image: {src} (Dockerfile COPY) does not exist; run `make build-all` first")
        local = staging / dest.strip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, local)
        if local.suffix == ".so":
            subprocess.run(["strip", "--strip-unneeded", str(local)], check=True)
        dests.append(dest.strip("/"))
    entries += ociarchive.tree_entries(staging, "/")
    have = {e[0].name for e in entries}
    entries += [e for e in ociarchive.parent_dirs(dests, 0) if e[0].name not in have]
    return entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=os.environ.get("IMAGE_REPO") or DEFAULT_REPO)
    ap.add_argument("--out", default=str(ROOT / "build" / "image"))
    ap.add_argument("--cache", default=os.environ.get("VGPU_IMAGE_CACHE", "/var/cache/k8s-vgpu"))
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("build-image: needs root (mmdebstrap --mode=root, chroot)")
    t0 = time.monotonic()
    ver = version()
    ref = f"{a.repo}:{ver}"
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "1767225600"))  # 2026-01-01 unless set
    cache = Path(a.cache)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stage = final_stage()
    oci_path = out / f"k8s-vgpu-{ver}.oci.tar"
    docker_path = out / f"k8s-vgpu-{ver}.docker.tar"
    info_path = out / f"k8s-vgpu-{ver}.json"

    # One build per output directory at a time (`make image` and a test session may overlap).
    out_lock = os.open(out / ".build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(out_lock, fcntl.LOCK_EX)
    base, _base_key = base_layer(cache, epoch)
    builder = builder_root(cache)
    venv_dir, venv_key = venv(cache, builder)
    copies = [ROOT / s for s, _ in stage.copies]
    scripts = [DOCKERFILE.read_text(), (HERE / "build.py").read_text(), (HERE / "ociarchive.py").read_text()]
    key = sha("image-v1", ref, str(epoch), base.digest, venv_key, tree_hash(copies), *scripts)
    if info_path.exists() and oci_path.exists() and docker_path.exists():
        info = json.loads(info_path.read_text())
        if info.get("key") == key:
            info["cached"] = "yes"
            _print(info)
            return 0
    staging = Path(tempfile.mkdtemp(prefix="vgpu-image-", dir=cache))
    try:
        app = ociarchive.write_layer(staging / "app.tar.gz", app_entries(venv_dir, stage, staging / "root"), epoch)  # type: ignore[arg-type]
        labels = {**stage.labels, "org.opencontainers.image.version": ver}
        cfg: dict[str, object] = {"Env": stage.env, "Cmd": stage.cmd, "WorkingDir": "/", "Labels": labels}
        history = [f"mmdebstrap --variant=essential {SUITE} + {' '.join(BASE_PACKAGES)}", "k8s-vgpu /opt/vgpu + COPY"]
        config = ociarchive.image_config([base, app], cfg, epoch, history)
        manifest = ociarchive.oci_manifest([base, app], config, {"org.opencontainers.image.version": ver})
        digest = ociarchive.write_oci_archive(oci_path, ref, [base, app], config, manifest, epoch)
        ociarchive.write_docker_archive(docker_path, ref, [base, app], config, epoch)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    info = {
        "image": ref,
        "digest": digest,
        "config_digest": ociarchive._sha(config),
        "size_bytes": base.tar_size + app.tar_size,
        "compressed_bytes": base.size + app.size,
        "base_layer_bytes": base.size,
        "app_layer_bytes": app.size,
        "oci_archive": str(oci_path),
        "docker_archive": str(docker_path),
        "key": key,
        "build_s": round(time.monotonic() - t0, 1),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    info["cached"] = "no"
    _print(info)
    return 0


def _print(info: dict[str, object]) -> None:
    for k, v in info.items():
        if k != "key":
            print(f"{k}={v}")


if __name__ == "__main__":
    sys.exit(main())
