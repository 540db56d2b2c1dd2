#!/usr/bin/env bash
# Build the self-contained Python application for the deb/rpm: a venv that
# will live at /opt/vgpu on the target, staged under DESTROOT/opt/vgpu.
#
#   packaging/build-venv.sh DESTROOT          build DESTROOT/opt/vgpu
#   packaging/build-venv.sh --relock          re-resolve packaging/requirements.lock
#
# The venv is made by the TARGET's interpreter ($VGPU_TARGET_PYTHON, default
# /usr/bin/python3): its bin/python links to that path and compiled wheels
# (grpcio, msgspec, psutil, ...) are chosen for its ABI, so a package runs only
# where the same Python (major.minor) lives at the same path.  Debian 12 and
# Ubuntu 23.04 have /usr/bin/python3 = 3.11; see docs/developers/node-setup.md.
#
# Dependencies come pinned from packaging/requirements.lock (binary wheels
# only, --no-deps: the lock is the complete closure); the project itself is
# installed from a clean copy of its source (never built in-tree, so nothing
# is written into the checkout).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PY=${VGPU_TARGET_PYTHON:-/usr/bin/python3}
PREFIX=/opt/vgpu
LOCK=$HERE/requirements.lock

die() { echo "build-venv: $*" >&2; exit 1; }

[ -x "$PY" ] || die "target Python $PY not found (set VGPU_TARGET_PYTHON)"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || die "$PY is older than 3.10"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY has no venv/ensurepip (Debian: apt-get install python3-venv)"

if [ "${1:-}" = "--relock" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  "$PY" -m venv "$tmp/v"
  deps=$("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
EOF
)
  mapfile -t reqs <<<"$deps"
  "$tmp/v/bin/pip" install -q --only-binary :all: "${reqs[@]}"
  { sed -n '1,/^[^#]/{/^#/p}' "$LOCK"; "$tmp/v/bin/pip" freeze | grep -vE '^(pip|setuptools|wheel)=='; } > "$LOCK.new"
  mv "$LOCK.new" "$LOCK"
  echo "build-venv: wrote $LOCK"
  exit 0
fi

[ $# -eq 1 ] || die "usage: $0 DESTROOT | --relock"
DEST=$(mkdir -p "$1" && cd "$1" && pwd)
STAGE=$DEST$PREFIX
rm -rf "$STAGE"
mkdir -p "$(dirname "$STAGE")"

"$PY" -m venv "$STAGE"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$STAGE/bin/python" -m pip install -q --no-deps --only-binary :all: -r "$LOCK" 2> >(grep -v 'WARNING: Location' >&2)

# A clean copy of the project's source: setuptools builds in-tree.
src=$(mktemp -d); trap 'rm -rf "$src"' EXIT
cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$src/"
for pkg in vgpu nodecore runtime_hook device_plugin dra_plugin monitor node_setup vgpu_scheduler vgpuctl; do
  cp -r "$ROOT/$pkg" "$src/$pkg"
done
find "$src" -name __pycache__ -prune -exec rm -rf {} +
# setuptools >= 70.1 carries bdist_wheel; removed again below with pip.
"$STAGE/bin/python" -m pip install -q --only-binary :all: "setuptools>=70.1"
"$STAGE/bin/python" -m pip install -q --no-deps --no-build-isolation "$src"

# Tools the installed application does not need.
"$STAGE/bin/python" -m pip uninstall -q -y setuptools pip >/dev/null 2>&1 || true
rm -f "$STAGE"/bin/activate* "$STAGE"/bin/Activate.ps1 "$STAGE"/bin/pip*
rm -rf "$STAGE"/lib/python3*/site-packages/_distutils_hack "$STAGE"/lib/python3*/site-packages/distutils-precedence.pth
find "$STAGE" -name direct_url.json -delete
find "$STAGE" -name RECORD -path '*.dist-info/*' -delete   # lists staging paths; no pip in the venv to use it

# Wheels ship unstripped extension modules: strip them (smaller, and what a distribution does).
find "$STAGE" -name '*.so' -type f -exec strip --strip-unneeded {} +

# Point the console scripts and pyvenv.cfg at the install path.  -I: the
# daemons and the hook run as root; ignore PYTHON* variables and user site.
for f in "$STAGE"/bin/*; do
  [ -f "$f" ] && [ ! -L "$f" ] || continue
  if head -c 2 "$f" | grep -q '#!'; then
    sed -i "1s|^#!.*/python[0-9.]*\$|#!$PREFIX/bin/python -I|" "$f"
  fi
done
sed -i "s|^command = .*|command = $PY -m venv $PREFIX|" "$STAGE/pyvenv.cfg"

# Byte-compile once, validated by nothing but presence: the venv is owned by
# the package manager, and the hook's start-up time matters.
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
"$PY" -m compileall -q -j0 --invalidation-mode unchecked-hash -s "$STAGE" -p "$PREFIX" "$STAGE/lib" >/dev/null

if grep -rlI --exclude='*.pyc' "$STAGE" "$STAGE" >/dev/null 2>&1; then
  grep -rlI --exclude='*.pyc' "$STAGE" "$STAGE" >&2
  die "staging path left in the files above"
fi
"$STAGE/bin/python" -I -c 'import vgpu, nodecore, runtime_hook, device_plugin, dra_plugin, monitor, node_setup, vgpu_scheduler, vgpuctl, grpc, msgspec, psutil' \
  || die "the staged venv cannot import the application"
echo "build-venv: $STAGE ($("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])'))"
