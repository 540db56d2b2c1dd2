#!/bin/sh
# Install the Debian packages a make target needs, when they are missing:
#     packaging/host-deps.sh demo|deb|rpm|test|image
# The names exist in Debian 12 and in Ubuntu 24.04 (main/universe) alike.
# A no-op (two dpkg queries) when everything is there.  Installs only as root on a Debian-family
# system; elsewhere it names what is missing and lets the target try anyway.
set -eu

case "${1:-}" in
  demo) need="build-essential python3-venv runc busybox-static" ;;
  deb|rpm) need="build-essential python3-venv binutils" ;;
  image) need="mmdebstrap util-linux binutils ca-certificates" ;;
  # Everything `make test`'s suites start for real (containerd, runc, podman, a debootstrap'd root,
  # the packages' tools, the image build): nothing may be skipped for a missing package.
  # prometheus: the real Prometheus and promtool the metrics and alert tests start themselves.
  test) need="build-essential python3-venv python3-dev python3-yaml binutils runc containerd busybox-static
              debootstrap mmdebstrap rpm lintian systemd podman iproute2 procps psmisc util-linux
              ca-certificates prometheus" ;;
  *) echo "usage: $0 demo|deb|rpm|test|image" >&2; exit 2 ;;
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
# Packages installed only for their programs, whose service must not run (now or at boot): the tests
# start their own instance on loopback.  policy-rc.d (exit 101) keeps the maintainer scripts from
# starting it; ours only for this install, and never replacing one the machine already has.
quiet=""
case " $missing " in *" prometheus "*) quiet="prometheus" ;; esac
if [ -n "$quiet" ] && [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -q >/dev/null
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing >/dev/null
for s in $quiet; do
  command -v systemctl >/dev/null 2>&1 || continue
  systemctl disable --quiet "$s.service" 2>/dev/null || true  # works without a running systemd too
  # a policy-rc.d of the machine's own that allowed the start: stop the service this install started
  if [ -d /run/systemd/system ] && systemctl is-active --quiet "$s.service" 2>/dev/null; then
    systemctl stop "$s.service" || true
  fi
done
