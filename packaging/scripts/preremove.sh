#!/bin/sh
# k8s-vgpu pre-removal.  deb: prerm remove|upgrade|deconfigure|failed-upgrade;
# rpm: %preun <remaining-count> (0 = erase, 1 = upgrade).
#
# On removal (not upgrade): stop and disable the units (the monitor's stop path resumes every
# process it suspended), and take the hook out of containerd while /usr/bin/vgpu-hook still exists.
set -e

case "$1" in
  remove|0) ;;
  *) exit 0 ;;
esac

units="vgpu-device-plugin.service vgpu-dra-plugin.service vgpu-monitor.service"
if command -v systemctl >/dev/null 2>&1; then
  if [ -d /run/systemd/system ]; then
    # shellcheck disable=SC2086
    systemctl stop $units || true
  fi
  # shellcheck disable=SC2086
  systemctl disable $units >/dev/null 2>&1 || true
fi

if [ -e /etc/containerd/config.toml ] && command -v vgpu-hook >/dev/null 2>&1; then
  if vgpu-hook containerd uninstall; then
    if [ "${VGPU_CONFIGURE_CONTAINERD:-0}" = 1 ] && [ -d /run/systemd/system ]; then
      systemctl restart containerd.service || echo "k8s-vgpu: restarting containerd failed" >&2
    else
      echo "k8s-vgpu: hook removed from containerd's configuration; apply it with: systemctl restart containerd"
    fi
  else
    echo "k8s-vgpu: 'vgpu-hook containerd uninstall' failed; check /etc/containerd/config.toml" >&2
  fi
fi
exit 0
