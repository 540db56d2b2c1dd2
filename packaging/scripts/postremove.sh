#!/bin/sh
# k8s-vgpu post-removal.  deb: postrm remove|purge|upgrade|...; rpm: %postun <remaining-count>.
# purge (deb) removes the state and logs; dpkg itself removes the conffile /etc/vgpu/config.toml.
# rpm has no purge: an erase keeps /var/lib/vgpu and /var/log/vgpu (docs/developers/node-setup.md).
set -e

case "$1" in
  purge)
    rm -rf /var/lib/vgpu /var/log/vgpu
    rmdir /etc/vgpu 2>/dev/null || true
    ;;
  remove|0)
    ;;
  *) exit 0 ;;
esac

if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
