#!/bin/sh
# Install the Debian packages a make target needs, when they are missing:
#     packaging/host-deps.sh demo|deb|rpm
# A no-op (two dpkg queries) when everything is there.  Installs only as root on a Debian-family
# system; elsewhere it names what is missing and lets the target try anyway.
set -eu

case "${1:-}" in
  demo) need="build-essential python3-venv runc busybox-static" ;;
  deb|rpm) need="build-essential python3-venv binutils" ;;
  *) echo "usage: $0 demo|deb|rpm" >&2; exit 2 ;;
esac

command -v dpkg-query >/dev/null 2>&1 || exit 0   # not Debian-like: nothing to check against
missing=""
for p in $need; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "make $1: missing Debian packages:$missing (apt-get install$missing)" >&2
  exit 0
fi
echo "make $1: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing >/dev/null
